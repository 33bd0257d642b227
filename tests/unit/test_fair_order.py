"""The order a replica's queue runs its jobs in (:mod:`apbv.serve.scheduler.fair_order`, a pure
rule): deadlines first, then standing questions' evaluations oldest chunk first, then round robin
over streams and the chat requests, each lane in arrival order."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from apbv.serve.scheduler.fair_order import MAX_LANES, next_job, run_order, take_turn


@dataclass
class _Job:
    name: str
    arrival: int
    stream_id: str | None = None
    evaluates: float | None = None
    deadline: float = math.inf

    @property
    def key(self) -> tuple[float, int]:
        return (self.deadline, self.arrival)


def _order(jobs: list[_Job], turns: dict[str, int] | None = None) -> list[str]:
    return [jobs[i].name for i in run_order(jobs, turns or {})]


def test_a_camera_pushing_in_a_burst_does_not_hold_the_others_back():
    # camera a pushed 4 chunks at once, b and c one each just after: FIFO would run a's four
    # first; round robin gives b and c their turn after a's first
    jobs = [_Job(f"a{i}", i, "a") for i in range(4)] + [_Job("b0", 4, "b"), _Job("c0", 5, "c")]
    assert _order(jobs) == ["a0", "b0", "c0", "a1", "a2", "a3"]


def test_the_lane_served_least_recently_goes_first_and_a_lane_keeps_its_order():
    jobs = [_Job("a1", 10, "a"), _Job("b1", 11, "b"), _Job("a2", 12, "a")]
    turns = {"a": 0, "b": 1}  # b was served last: a's oldest job first
    assert _order(jobs, turns) == ["a1", "b1", "a2"]
    assert _order(jobs, {"a": 1, "b": 0}) == ["b1", "a1", "a2"]
    assert turns == {"a": 0, "b": 1}  # run_order leaves the turns as they were


def test_an_evaluation_runs_before_later_appends_of_other_streams():
    # a's chunk (arrived at 100.0) was appended; meanwhile b..d pushed: its evaluation is next
    jobs = [_Job("b-append", 5, "b"), _Job("c-append", 6, "c"), _Job("d-append", 7, "d"),
            _Job("a-eval", 8, "a", evaluates=100.0), _Job("e-eval", 9, "e", evaluates=99.0)]
    assert _order(jobs) == ["e-eval", "a-eval", "b-append", "c-append", "d-append"]


def test_a_deadline_goes_before_everything_and_chat_requests_share_one_lane():
    jobs = [_Job("chat1", 1), _Job("chat2", 2), _Job("s-append", 3, "s"),
            _Job("s-eval", 4, "s", evaluates=1.0), _Job("urgent", 5, deadline=50.0)]
    assert _order(jobs) == ["urgent", "s-eval", "chat1", "s-append", "chat2"]


def test_next_job_indexes_the_waiting_list_and_turns_are_bounded():
    jobs = [_Job("a", 3, "a"), _Job("b", 1, "b")]
    assert next_job(jobs, {}) == 1  # never served either: the older job
    turns: dict[str, int] = {}
    for i in range(MAX_LANES + 10):
        take_turn(_Job("x", i, f"s{i}"), turns)
    assert len(turns) == MAX_LANES and "s0" not in turns and turns[f"s{MAX_LANES + 9}"] == \
        max(turns.values())


def _replica_queue(jobs: tuple[tuple[str, str, float | None], ...]) -> list[str]:
    """Admit ``(name, stream, evaluates)`` close-stream jobs into a fresh replica queue, in that
    order; the names as the queue lists them waiting, then as it hands them out one by one."""
    import asyncio

    from apbv.serve.ranks.ops import CloseStream
    from apbv.serve.scheduler.admission import Admission

    async def main() -> list[str]:
        adm = Admission(16)
        names = {}
        for name, stream, evaluates in jobs:
            job = adm.admit(None, {}, op=CloseStream(stream), predicted_s=0.0,
                            stream_id=stream, evaluates=evaluates)
            names[id(job)] = name
        taken = [names[id(j)] for j in adm.waiting()]
        for _ in jobs:
            job = await adm.next()
            adm.done(job)
            taken.append(names[id(job)])
        return taken

    return asyncio.run(main())


def test_the_replica_queue_takes_its_jobs_in_that_order():
    listed = _replica_queue((("a0", "a", None), ("a1", "a", None), ("a2", "a", None),
                             ("b0", "b", None), ("c-eval", "c", 7.0)))
    assert listed[:5] == ["c-eval", "a0", "b0", "a1", "a2"]  # waiting
    assert listed[5:] == ["c-eval", "a0", "b0", "a1", "a2"]  # taken


def test_the_replica_queue_serves_a_burst_round_robin():
    listed = _replica_queue((("a0", "a", None), ("a1", "a", None), ("a2", "a", None),
                             ("b0", "b", None), ("c0", "c", None)))
    assert listed[5:] == ["a0", "b0", "c0", "a1", "a2"]  # FIFO: a0 a1 a2 b0 c0


def test_a_watch_evaluation_is_queued_as_the_evaluation_of_its_oldest_chunk():
    """The evaluator hands the replica queue the arrival of the oldest chunk an evaluation is
    the first to see (what the rule orders evaluations by), and its event splits the latency
    into the append's and the evaluation's seconds."""
    import asyncio
    from types import SimpleNamespace

    pytest.importorskip("prometheus_client")

    from apbv.serve.front.metrics import Metrics
    from apbv.serve.watches.evaluator import Evaluator
    from apbv.serve.watches.events import EventHub
    from apbv.serve.watches.state import StreamWatches
    from tests.unit.test_watch_budget import _watch

    async def main() -> tuple[list, list]:
        live = SimpleNamespace(id="s", closing=False, append_s=(0.25, 0.5),
                               recent=SimpleNamespace(tokens=4))
        queued = []
        probs = iter([{"yes": 0.9, "no": 0.1}, {"yes": 0.1, "no": 0.9}])

        async def run(live_, op, evaluates=None):
            queued.append(evaluates)
            choices = [{"text": t, "prob": p} for t, p in next(probs).items()]
            return SimpleNamespace(choices=choices, ttft_s=0.01), 0.125

        registry = SimpleNamespace(live={"s": live}, run=run)
        hub = EventHub()
        sub = hub.subscribe(None, None)
        watch = _watch("s")
        of = {"s": StreamWatches({watch.id: watch})}
        evaluator = Evaluator(registry, of, hub, Metrics("m"))
        evaluator.appended(live, 1.0, 100.0, 1.0)
        await of["s"].task
        live.recent.tokens += 4  # the next chunk's tokens: asked again, not reused
        evaluator.appended(live, 2.0, 101.5, 1.0)
        await of["s"].task
        return queued, [sub.queue.get_nowait() for _ in range(sub.queue.qsize())]

    queued, events = asyncio.run(main())
    assert queued == [100.0, 101.5]
    assert [e["answer"] for e in events] == ["no"]  # yes -> no
    assert events[0]["stages"]["append_wait_s"] == 0.25 and \
        events[0]["stages"]["append_s"] == 0.5 and events[0]["stages"]["eval_wait_s"] == 0.125
