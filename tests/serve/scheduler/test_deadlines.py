"""Deadlines and stalls without a server: admission counts the decode of the jobs ahead (a
running job past its prediction at its tokens still to come), learns the seconds per token,
refuses non-finite deadlines and, at dequeue, a job whose deadline can no longer be met; a
replica whose job runs long pings its ranks and is ``stalled`` while one does not answer, and
the failure then names the rank that did not answer."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("ray")

from apbv.openai.chat_body import typed_field  # noqa: E402
from apbv.openai.policy import ClientError  # noqa: E402
from apbv.serve.front.metrics import Metrics  # noqa: E402
from apbv.serve.ranks.group import RankGroup, RankLost, describe_lost  # noqa: E402
from apbv.serve.scheduler import replicas as replicas_module  # noqa: E402
from apbv.serve.scheduler.admission import DECODE_BOUNDS, LEARN_RATE, Admission  # noqa: E402
from apbv.serve.scheduler.replicas import Replica, overall_status, pick  # noqa: E402


def _call(deadline_ms: float | None = None) -> SimpleNamespace:
    return SimpleNamespace(deadline_ms=deadline_ms, downloaded=None, request=None)


def _refused(exc: pytest.ExceptionInfo, status: int, text: str) -> None:
    assert exc.value.status == status and text in exc.value.message, (status, exc.value.message)


def _queued_ms(exc: pytest.ExceptionInfo, full_ms: int, started: float) -> None:
    """The work queued ahead is ``full_ms`` less the time the running job has run (whole ms,
    rounded down): a loaded machine may take more than 1 ms between start and refusal."""
    found = re.search(r"the predicted TTFT is 2000 ms plus (\d+) ms", exc.value.message)
    assert found, exc.value.message
    ran_ms = (time.monotonic() - started) * 1000
    assert full_ms - ran_ms - 1 <= int(found.group(1)) <= full_ms, (full_ms, ran_ms, found[0])


def test_the_decode_of_the_jobs_ahead_is_counted():
    """2 s of TTFT and 10 ms per token: a 3 s deadline behind a 1024-token job that just
    started waits for its 12.24 s; one behind it and a queued job with an earlier deadline
    for both."""
    async def scenario() -> None:
        adm = Admission(8, predictor=lambda call, measured: 2.0, decode_s=0.01)
        running = adm.admit(_call(), {}, max_tokens=1024)
        assert adm.expected_s(running) == pytest.approx(12.24)
        assert await adm.next() is running
        running.started = time.monotonic()
        adm.admit(_call(), {}, max_tokens=1024)  # no deadline: after every deadline
        with pytest.raises(ClientError) as exc:
            adm.admit(_call(3_000), {}, max_tokens=16)
        _queued_ms(exc, 12_240, running.started)
        _refused(exc, 503, "ms of work queued ahead, 1024 tokens of it decoding at 10.0 ms "
                           "per token")
        adm.admit(_call(15_000), {}, max_tokens=50)  # 12.24 + 2.5 s: fits
        with pytest.raises(ClientError) as exc:  # behind both: 12.24 + 2.5 + 2 s > 16.5 s
            adm.admit(_call(16_500), {}, max_tokens=16)
        _queued_ms(exc, 14_740, running.started)
        _refused(exc, 503, "ms of work queued ahead, 1074 tokens of it decoding")
        # A job that does not decode (a stream's append) adds no decode time.
        assert adm.expected_s(adm.admit(_call(), {}, predicted_s=0.5)) == 0.5

    asyncio.run(scenario())


def test_a_job_past_its_prediction_counts_its_tokens_still_to_come():
    async def scenario() -> None:
        adm = Admission(8, predictor=lambda call, measured: 2.0, decode_s=0.01)
        running = adm.admit(_call(), {}, max_tokens=1024)
        await adm.next()
        running.started = time.monotonic() - 100  # far past its 12.24 s
        running.generated = 24
        now = time.monotonic()
        assert adm.remaining_s(running, now) == pytest.approx(10.0)
        with pytest.raises(ClientError) as exc:  # 2 s + 10 s left: a 5 s deadline is missed
            adm.admit(_call(5_000), {})
        _refused(exc, 503, "plus 10000 ms of work queued ahead, 1000 tokens of it decoding")
        running.generated = 0  # still before its first token: all of the decode is left
        assert adm.remaining_s(running, now) == pytest.approx(10.24)
        running.started = now - 1.5  # 0.5 s of its TTFT left
        assert adm.remaining_s(running, now) == pytest.approx(10.74)
        running.generated = 1020
        assert adm.admit(_call(3_000), {}).predicted_s == 2.0  # 2 s + 0.04 s: it fits

    asyncio.run(scenario())


def test_seconds_per_token_are_learned_like_the_ttft_scale():
    adm = Admission(8, decode_s=0.1)
    for n in range(1, 6):
        adm.learn_decode(4.0, 400)  # 10 ms per token
        assert adm.decode_s == pytest.approx(0.1 * 0.1 ** (1 - (1 - LEARN_RATE) ** n))
    assert adm.decoded == 5
    before = adm.decode_s
    adm.learn_decode(1.0, 0)  # one token only: no decode measured
    adm.learn_decode(0.0, 10)
    assert (adm.decode_s, adm.decoded) == (before, 5)
    for _ in range(200):
        adm.learn_decode(1e-9, 1000)
    assert adm.decode_s == DECODE_BOUNDS[0]


@pytest.mark.parametrize("deadline", [math.nan, math.inf, -math.inf, -1.0])
def test_non_finite_deadlines_are_refused(deadline):
    async def scenario() -> None:
        adm = Admission(8, predictor=lambda call, measured: 0.0)
        with pytest.raises(ClientError) as exc:
            adm.admit(_call(deadline), {})
        _refused(exc, 400, f"deadline_ms must be a finite number >= 0, got {deadline!r}")
        assert len(adm) == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_a_json_body_with_a_non_finite_number_is_refused(literal):
    body = json.loads(f'{{"deadline_ms": {literal}, "fps": {literal}}}')  # Python's JSON reads
    for name in ("deadline_ms", "fps"):
        with pytest.raises(ClientError) as exc:
            typed_field(body, name, (int, float), 0)
        _refused(exc, 400, f"{name} must be a finite number >= 0, got")
    assert typed_field({"deadline_ms": 1e308}, "deadline_ms", (int, float), 0) == 1e308


class _Group:
    """A rank group whose requests wait for ``release`` and whose ranks' pings answer with
    ``lost`` (rank -> why)."""

    def __init__(self) -> None:
        self.pids, self.world_size = [11, 12], 2
        self.release = asyncio.Event()
        self.lost: dict[int, str] = {}
        self.generated = 0

    async def submit(self, op, on_token, cancel):
        self.generated += 1
        await self.release.wait()
        if self.lost:
            raise RankLost(sorted(self.lost), why=describe_lost(self.lost))
        return SimpleNamespace(vision_cache_hit=True, ttft_s=0.1, token_ids=[1, 2, 3],
                               finish_reason="length", frames=0, context_len=0, query_len=0)

    def unanswered(self, timeout_s: float = 5.0) -> dict[int, str]:
        return dict(self.lost)


def _chat(deadline_ms: float | None = None) -> SimpleNamespace:
    video = SimpleNamespace(path="/nonexistent.mp4")
    return SimpleNamespace(deadline_ms=deadline_ms, downloaded=None,
                           request=SimpleNamespace(video=video, max_new_tokens=8))


def test_a_job_whose_deadline_passed_while_queued_is_refused_at_dequeue():
    async def scenario() -> None:
        group = _Group()
        replica = Replica(0, group, Admission(4, predictor=lambda call, measured: 0.05),
                          Metrics(), lambda _: None)
        replica.status = "ready"
        late = replica.admission.admit(_chat(100), {}, max_tokens=8)  # 0.05 s: fits now
        tight = replica.admission.admit(_chat(1_000), {}, max_tokens=8)
        tight.predicted_s = 0.95  # as if the machine were slow: it cannot start in time
        await asyncio.sleep(0.2)
        worker = asyncio.ensure_future(replica.run())
        with pytest.raises(ClientError) as exc:
            await asyncio.wait_for(late.future, 5)
        _refused(exc, 504, "the deadline of 100 ms passed while it waited: it waited ")
        _refused(exc, 504, "ms in the queue and did not run")
        with pytest.raises(ClientError) as exc:
            await asyncio.wait_for(tight.future, 5)
        _refused(exc, 504, "the deadline of 1000 ms would pass before its predicted TTFT of "
                           "950 ms")
        assert group.generated == 0  # neither reached the ranks
        on_time = replica.admission.admit(_chat(60_000), {}, max_tokens=8)
        await asyncio.sleep(0.05)
        group.release.set()
        result, _ = await asyncio.wait_for(on_time.future, 5)
        assert result.token_ids == [1, 2, 3] and group.generated == 1
        assert replica.metrics.registry.get_sample_value(
            "apbv:requests_total", {"outcome": "deadline_missed"}) == 2
        worker.cancel()

    asyncio.run(scenario())


def test_a_job_running_long_pings_its_ranks_and_the_replica_is_stalled(monkeypatch):
    monkeypatch.setattr(replicas_module, "STALL_FLOOR_S", 0.3)
    monkeypatch.setattr(replicas_module, "STALL_POLL_S", 0.05)

    async def scenario() -> None:
        group, other = _Group(), _Group()
        metrics = Metrics()
        replica = Replica(0, group, Admission(4, predictor=lambda call, measured: 0.01,
                                              decode_s=0.001), metrics, lambda _: None)
        spare = Replica(1, other, Admission(4), metrics, lambda _: None)
        replica.peers = spare.peers = [replica, spare]
        replica.status = spare.status = "ready"
        worker = asyncio.ensure_future(replica.run())
        job = replica.admission.admit(_chat(), {}, max_tokens=8)
        await asyncio.sleep(0.5)  # past the floor, all ranks answering: still ready
        assert replica.status == "ready" and replica.describe()["running"]
        group.lost = {1: "did not answer within 5 s"}
        started = time.monotonic()
        while replica.status != "stalled":
            assert time.monotonic() - started < 2, replica.describe()
            await asyncio.sleep(0.02)
        described = replica.describe()
        assert described["stalled_ranks"] == [1] and described["running_s"] > 0.5
        assert described["predicted_s"] == pytest.approx(0.018)
        assert metrics.registry.get_sample_value("apbv:replica_stalled", {"replica": "0"}) == 1
        assert overall_status([replica]) == "stalled"
        assert overall_status([replica, spare]) == "ready"
        assert pick([replica, spare], _chat().request, affinity=False) is spare
        spare.status = "starting"  # none ready: the stalled one queues it (it may recover)
        assert pick([replica, spare], _chat().request, affinity=False) is replica
        spare.status = "ready"
        group.lost = {}  # it answers again (SIGCONT)
        while replica.status != "ready":
            assert time.monotonic() - started < 4, replica.describe()
            await asyncio.sleep(0.02)
        assert "stalled_ranks" not in replica.describe()
        group.lost = {1: "did not answer within 5 s"}
        while replica.status != "stalled":
            await asyncio.sleep(0.02)
        group.release.set()  # the collective timed out: the request fails naming the rank
        with pytest.raises(ClientError) as exc:
            await asyncio.wait_for(job.future, 5)
        _refused(exc, 503, "replica 0: rank(s) 1 of the engine group were lost (rank 1 did "
                           "not answer within 5 s)")
        assert replica.status == "degraded" and replica.stalled == []
        assert metrics.registry.get_sample_value("apbv:replica_stalled", {"replica": "0"}) == 0
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)

    asyncio.run(scenario())


def test_a_failed_request_names_the_ranks_that_did_not_answer():
    """RankGroup._outcome after a failure: the ping decides between a lost rank (dead, or
    not answering: named with why) and the ranks' own error."""
    group = RankGroup(None, 2)

    async def outcome(lost: dict[int, str]) -> None:
        group.unanswered = lambda timeout_s=5.0: lost

        async def fails() -> None:
            raise RuntimeError("gloo timeout")

        hung = asyncio.ensure_future(asyncio.sleep(60))
        await group._outcome([asyncio.ensure_future(fails()), hung])

    with pytest.raises(RankLost, match=r"rank\(s\) 1 of the engine group were lost \(rank 1 "
                                       r"did not answer within 5 s\); the request failed"):
        asyncio.run(outcome({1: "did not answer within 5 s"}))
    with pytest.raises(RankLost, match=r"rank\(s\) 0, 1 of the engine group were lost \(actor "
                                       r"died\)"):
        asyncio.run(outcome({0: "died", 1: "died"}))
    with pytest.raises(RankLost, match=r"\(rank 0 died; rank 1 did not answer within 5 s\)"):
        asyncio.run(outcome({0: "died", 1: "did not answer within 5 s"}))


def test_the_decode_prior_of_the_cost_model():
    """One decode step: the weight reads of every layer dominate a 7B model on a GPU (tens of
    ms with the host's per-layer overhead); attending to a longer cache costs more."""
    from apbv import cost

    dims = cost.preset_dims("qwen2.5-vl-7b")
    h200 = cost.decode_token_s(dims, context_len=1000, world_size=8, hw=cost.hardware("h200"))
    assert 0.005 < h200 < 0.1, h200
    short, long = (cost.decode_token_s(dims, context_len=n, world_size=8,
                                       hw=cost.hardware("cpu")) for n in (1000, 131072))
    assert h200 < short < long, (h200, short, long)
