"""The server's open streams without ranks: the --max-streams limit, the idle sweep, a stream
lost with its replica's ranks (410 naming why, remembered for a while), and how each end is
told to the stream's event streams and webhooks (``stream.closed``)."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("fastapi")

from apbv.engine.request import Request, StreamRef  # noqa: E402
from apbv.engine.stream_plan import StreamSpec  # noqa: E402
from apbv.openai.policy import ClientError, Limits, MediaPolicy  # noqa: E402
from apbv.serve.app import live_streams  # noqa: E402
from apbv.serve.front.front import Front  # noqa: E402
from apbv.serve.front.metrics import Metrics  # noqa: E402
from apbv.serve.ranks.ops import Generate  # noqa: E402
from apbv.serve.scheduler.admission import Admission  # noqa: E402
from apbv.serve.scheduler.replicas import Replica  # noqa: E402
from apbv.serve.streams.registry import LiveStream, StreamOptions  # noqa: E402
from apbv.serve.streams.routes import Streams  # noqa: E402
from tests.serve.hooks import webhook_receiver  # noqa: E402

KIB = 1024


def _streams(**options) -> tuple[Streams, Replica]:
    group = SimpleNamespace(pids=[], world_size=1)
    replica = Replica(0, group, Admission(2), Metrics(), lambda _: None)
    replica.status = "ready"
    front = Front(None, Limits(), MediaPolicy(), "m", Metrics(), None)
    streams, _ = live_streams(front, [replica], StreamOptions(budget_bytes=100 * KIB, **options))
    return streams, replica


def _add(streams: Streams, replica: Replica, name: str, idle_for: float = 0.0) -> LiveStream:
    """A stream as open would register it, not yet opened on any rank."""
    live = LiveStream(id=name, replica=replica, generation=replica.generation,
                      spec=StreamSpec(height=28, width=28), sized=False,
                      pixels=(None, None), reserved=10 * KIB)
    live.used = time.monotonic() - idle_for
    streams.registry.live[name] = live
    return live


def _asked(question: str) -> Generate:
    """A question over a stream's held KV, as the server queues it."""
    return Generate(Request(video=StreamRef("s"), question=question, mode="exact"))


def _refused(exc: pytest.ExceptionInfo, status: int, text: str) -> None:
    assert exc.value.status == status and text in exc.value.message, (status, exc.value.message)


def test_max_streams_refuses_the_next_open_with_the_limit_named():
    streams, replica = _streams(max_streams=2)
    assert streams.registry.place(10 * KIB) is replica
    _add(streams, replica, "a")
    _add(streams, replica, "b")
    with pytest.raises(ClientError) as exc:
        streams.registry.place(10 * KIB)
    _refused(exc, 429, "2 streams are open, the limit is 2 (--max-streams): close one first")
    asyncio.run(streams.registry.close(streams.registry.live["a"]))
    assert streams.registry.place(10 * KIB) is replica and set(streams.registry.live) == {"b"}


def test_idle_streams_are_closed_and_their_budget_freed():
    streams, replica = _streams(idle_s=0.2)
    _add(streams, replica, "idle", idle_for=5.0)
    busy = _add(streams, replica, "busy")
    assert streams.registry.held(replica) == 20 * KIB

    async def run() -> None:
        sweeper = asyncio.create_task(streams.registry.sweep())
        for _ in range(20):  # the sweep looks every idle_s / 2 = 0.1 s
            await asyncio.sleep(0.05)
            busy.used = time.monotonic()  # a client keeps using this one
            if "idle" not in streams.registry.live:
                break
        sweeper.cancel()

    asyncio.run(run())
    assert set(streams.registry.live) == {"busy"} and streams.registry.held(replica) == 10 * KIB
    with pytest.raises(ClientError) as exc:
        streams.registry.get("idle")
    _refused(exc, 410, "stream 'idle' was closed after 0.2 s without use (--stream-idle-s); "
                       "open a new stream")


def test_a_job_failed_by_lost_ranks_forgets_the_stream_streamed_or_not():
    """However the job's outcome is awaited (a streamed ask only hands its job to the SSE
    writer), a failure after the replica's ranks were rebuilt frees the stream at once."""
    async def scenario() -> list[bool]:
        streams, replica = _streams()
        replica.admission = Admission(8)  # no dispatcher here: the jobs stay queued
        kept = []
        for stream in (True, False):
            live = _add(streams, replica, "s", idle_for=0.0)
            live.generation = replica.generation
            job = streams.registry.admit(live, _asked("What is shown?"), sse=stream)
            replica.generation += 1  # a rank died while the job waited
            job.future.set_exception(ClientError(410, "lost"))
            await asyncio.sleep(0)  # the done-callbacks run
            kept.append("s" in streams.registry.live)
            job.future.exception()  # retrieved: no "never retrieved" warning
        other = _add(streams, replica, "t")
        job = streams.registry.admit(other, _asked("q"), sse=True)
        job.future.set_exception(ClientError(400, "bad question"))  # ranks still the same
        await asyncio.sleep(0)
        job.future.exception()
        return [*kept, "t" in streams.registry.live]

    assert asyncio.run(scenario()) == [False, False, True]


def test_a_stream_lost_with_its_ranks_is_410_then_forgotten():
    streams, replica = _streams()
    _add(streams, replica, "s")
    assert streams.registry.get("s").id == "s"
    replica.generation += 1  # a rank died and the group was rebuilt
    replica.last_loss = "rank(s) 1: killed by Ray's out-of-memory monitor"
    lost = ("stream 's' was lost: replica 0's ranks were lost (rank(s) 1: killed by Ray's "
            "out-of-memory monitor) and its group is rebuilt; open a new stream")
    with pytest.raises(ClientError) as exc:
        streams.registry.get("s")
    _refused(exc, 410, lost)
    assert streams.registry.held(replica) == 0  # its budget is free again
    with pytest.raises(ClientError) as exc:  # remembered: the same answer
        streams.registry.get("s")
    _refused(exc, 410, lost)
    streams.registry.ended.keep_s = 0.0  # ... for a while
    with pytest.raises(ClientError) as exc:
        streams.registry.get("s")
    _refused(exc, 404, "no open stream 's'")




async def _wire(wire) -> list[tuple[str, dict]]:
    """An event stream's (event name, data) until it ends (each within 5 s)."""
    out = []
    while True:
        try:
            chunk = await asyncio.wait_for(wire.__anext__(), 5)
        except StopAsyncIteration:
            return out
        if not chunk.startswith(b":"):
            head, data = chunk.decode().split("\ndata: ", 1)
            out.append((head.removeprefix("event: "), json.loads(data)))


def test_every_end_is_told_once_to_its_event_streams_and_webhooks_and_remembered():
    """closed (DELETE), idle, lost (the replica's ranks) and server shutdown: each stream's
    event streams (by stream, by watch) end with its ``stream.closed``, an unfiltered one sees
    every end and goes on until the server stops; the watch's webhook gets the same event and
    its sender ends; later requests on each stream are answered with why it ended."""
    from apbv.serve.watches.events import Webhook
    from apbv.serve.watches.state import StreamWatches, Watch


    async def scenario() -> dict:
        streams, replica = _streams(idle_s=30)
        registry, hub = streams.registry, streams.registry.listener.hub
        live = {name: _add(streams, replica, name) for name in "abcd"}
        watch = Watch(None, None, None,  # its question is never evaluated here
                      id="w-b", stream="b", webhook=Webhook(hooks.url, hosts=("127.0.0.1",)))
        watch.sender = asyncio.ensure_future(watch.webhook.run())
        streams.registry.listener.of["b"] = StreamWatches(watches={"w-b": watch})
        wires = {name: hub.stream(hub.subscribe(**filters)) for name, filters in
                 [("a", {"stream": "a"}), ("w-b", {"watch": "w-b"}), ("every", {})]}
        for wire in wires.values():
            assert await wire.__anext__() == b": subscribed\n\n"
        hub.publish({"object": "watch.event", "stream": "a", "watch": "w-a", "answer": "yes"})
        await registry.close(live["a"])  # DELETE
        await registry.close(live["c"], "idle")  # the sweep's close
        replica.generation += 1  # rank 1 died: the rebuild tells its hooks
        replica.last_loss = "rank 1 killed by Ray's out-of-memory monitor"
        for hook in replica.on_lost:
            hook(replica)
        _add(streams, replica, "e")  # opened on the new group
        read = {name: asyncio.ensure_future(_wire(wires[name])) for name in ("a", "w-b")}
        by_stream, by_watch = await read["a"], await read["w-b"]
        await asyncio.wait_for(watch.sender, 5)  # the webhook sent its last event and ended
        registry.shutdown()  # the server stops: every remaining stream, every event stream
        assert set(registry.live) == set() and registry.held(replica) == 0
        hub.close()
        every = await _wire(wires["every"])
        refused = {}
        for name in "abcde":
            with pytest.raises(ClientError) as exc:
                registry.get(name)
            refused[name] = (exc.value.status, exc.value.message)
        return {"a": by_stream, "w-b": by_watch, "every": every, "refused": refused,
                "subscribers": len(hub.subscribers)}

    with webhook_receiver() as hooks:
        seen = asyncio.run(scenario())
    assert [(name, data.get("reason")) for name, data in seen["a"]] == \
        [("watch", None), ("stream.closed", "closed")], seen["a"]
    assert [(name, data["stream"], data["reason"], data["watches"])
            for name, data in seen["w-b"]] == [("stream.closed", "b", "lost", ["w-b"])]
    lost = seen["w-b"][0][1]["message"]
    assert lost == ("stream 'b' was lost: replica 0's ranks were lost (rank 1 killed by Ray's "
                    "out-of-memory monitor) and its group is rebuilt; open a new stream"), lost
    assert hooks.received == [seen["w-b"][0][1]], hooks.received
    ends = [(data["stream"], data["reason"]) for name, data in seen["every"]
            if name == "stream.closed"]
    assert sorted(ends) == [("a", "closed"), ("b", "lost"), ("c", "idle"), ("d", "lost"),
                            ("e", "server shutdown")], seen["every"]
    assert seen["subscribers"] == 0  # every event stream ended
    refused = seen["refused"]
    assert refused["a"] == (404, "no open stream 'a': it was closed by its client"), refused
    assert refused["b"] == (410, lost) and refused["d"][0] == 410, refused
    assert refused["c"] == (410, "stream 'c' was closed after 30 s without use "
                                 "(--stream-idle-s); open a new stream"), refused
    assert refused["e"] == (410, "stream 'e' was closed: the server is shutting down; open a "
                                 "new stream"), refused
