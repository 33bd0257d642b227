"""The server's open streams without ranks: the --max-streams limit, the idle sweep, and a
stream lost with its replica's ranks (410, then forgotten)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("fastapi")

from apbv.engine.request import Request, StreamRef  # noqa: E402
from apbv.engine.stream_plan import StreamSpec  # noqa: E402
from apbv.serve.admission import Admission  # noqa: E402
from apbv.serve.metrics import Metrics  # noqa: E402
from apbv.serve.ops import Generate  # noqa: E402
from apbv.serve.policy import ClientError, Limits  # noqa: E402
from apbv.serve.replicas import Replica  # noqa: E402
from apbv.serve.stream_registry import LiveStream, StreamOptions  # noqa: E402
from apbv.serve.streams import Streams  # noqa: E402

KIB = 1024


def _streams(**options) -> tuple[Streams, Replica]:
    group = SimpleNamespace(pids=[], world_size=1)
    replica = Replica(0, group, Admission(2), Metrics(), lambda _: None)
    replica.status = "ready"
    streams = Streams(SimpleNamespace(replicas=[replica],
                                      opt=SimpleNamespace(limits=Limits(), model_name="m"),
                                      metrics=Metrics()),
                      StreamOptions(budget_bytes=100 * KIB, **options))
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
    _refused(exc, 404, "no open stream 'idle'")


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
    with pytest.raises(ClientError) as exc:
        streams.registry.get("s")
    _refused(exc, 410, "stream 's' was lost: a rank of replica 0 died and its group was "
                       "rebuilt; open a new stream")
    assert streams.registry.held(replica) == 0  # its budget is free again
    with pytest.raises(ClientError) as exc:
        streams.registry.get("s")
    _refused(exc, 404, "no open stream 's'")
