"""The watches' budget and coalescing, without a server (:class:`apbv.serve.watches.routes.Watches`
over stand-in streams): a watch the replica cannot sustain is refused with the figures, a
chunk landing while an evaluation runs is folded into the next one and counted, and the lag
counts the running round."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")


from apbv.engine.request import Request, StreamRef  # noqa: E402
from apbv.openai.policy import ClientError  # noqa: E402
from apbv.serve.front.metrics import Metrics  # noqa: E402
from apbv.serve.watches.routes import Watches  # noqa: E402
from apbv.serve.watches.state import StreamWatches, Watch, lag_s  # noqa: E402
from apbv.watch.rules import Rule  # noqa: E402


def _watches(live: dict) -> Watches:
    registry = SimpleNamespace(live=live, on_append=None, on_forget=None,
                               appends=lambda replica: (0.0, 1.0))
    front = SimpleNamespace(metrics=Metrics("m"), model_name="m")
    return Watches(front, registry)


def _watch(stream: str, eval_s: float | None = None, every_s: float | None = None) -> Watch:
    request = Request(video=StreamRef(stream), question="Is there a flash?", mode="exact",
                      max_new_tokens=1, choices=("yes", "no"))
    return Watch(request, Rule(), every_s, id=f"w-{stream}-{eval_s}-{every_s}", stream=stream,
                 eval_s=eval_s)


def test_a_watch_the_replica_cannot_sustain_is_refused_with_the_figures():
    replica = SimpleNamespace(index=0)
    a, b = SimpleNamespace(id="a", replica=replica), SimpleNamespace(id="b", replica=replica)
    watches = _watches({"a": a, "b": b})
    watches.of["a"] = StreamWatches({"w1": _watch("a", 0.35)}, chunk_s=1.0)
    watches.of["b"] = StreamWatches({"w2": _watch("b", 0.4)}, chunk_s=1.0)
    assert watches.load(a) == pytest.approx(0.75)
    watches._check_budget(b, _watch("b", every_s=2.0))  # 0.4 s per 2 s: 0.95 in all
    with pytest.raises(ClientError) as info:
        watches._check_budget(a, _watch("a"))  # 0.35 s per 1 s chunk: 1.1 in all
    assert info.value.status == 429
    assert "needs about 0.350 s of evaluation per 1 s of footage (35% of the replica), and " \
           "the watches there already take 75%" in info.value.message
    watches.of["c"] = StreamWatches({}, chunk_s=1.0)  # nothing measured there: admitted
    c = SimpleNamespace(id="c", replica=replica)
    watches.registry.live["c"] = c
    watches._check_budget(c, _watch("c"))


def test_chunks_landing_during_an_evaluation_are_coalesced_into_the_newest_state():
    async def main():
        live = SimpleNamespace(id="s", closing=False)
        watches = _watches({"s": live})
        gate, seen = asyncio.Event(), []

        async def round_(live_, sw, footage_ts, arrived):
            seen.append(footage_ts)
            await gate.wait()

        watches.evaluator._round = round_
        sw = watches.of["s"] = StreamWatches({"w": _watch("s")})
        watches.evaluator.appended(live, 1.0, 100.0, 1.0)
        await asyncio.sleep(0)  # the first round runs (blocked on the gate)
        assert sw.running == 100.0 and lag_s(sw) > 0
        for ts, arrived in ((2.0, 101.0), (3.0, 102.0), (4.0, 103.0)):
            watches.evaluator.appended(live, ts, arrived, 1.0)
        assert sw.coalesced == 2 and sw.pending == (4.0, 101.0)  # the oldest unseen arrival
        gate.set()
        await sw.task
        assert seen == [1.0, 4.0] and sw.pending is None and lag_s(sw) == 0.0
    asyncio.run(main())


def test_a_watch_is_due_once_per_state_or_every_s_of_footage():
    every_chunk, every_2s = _watch("s"), _watch("s", every_s=2.0)
    assert every_chunk.due(1.0) and every_2s.due(1.0)  # never evaluated
    every_chunk.last_ts = every_2s.last_ts = 1.0
    assert not every_chunk.due(1.0) and every_chunk.due(1.5)  # the same state: not again
    assert not every_2s.due(2.5) and every_2s.due(3.0)
