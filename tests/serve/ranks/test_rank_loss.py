"""Every way a rank can die is a lost rank, without a cluster (stand-in actors, the ranks'
processes real but idle): a ping or a rank's call failing with any Ray error is a lost rank
named briefly (Ray's out-of-memory monitor, an unavailable actor, a dead one), a silent rank
is one that did not answer; an idle replica whose rank process is SIGKILLed is never
``ready`` again until its group is rebuilt, without a request; a failure's client message is
one short line whatever the exception's text."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ray")
pytest.importorskip("prometheus_client")

from ray.exceptions import (  # noqa: E402
    ActorDiedError,
    ActorUnavailableError,
    GetTimeoutError,
    OutOfMemoryError,
)

from apbv.openai.policy import ClientError  # noqa: E402
from apbv.serve.front.metrics import Metrics  # noqa: E402
from apbv.serve.ranks import group as group_module  # noqa: E402
from apbv.serve.ranks.group import RankGroup, RankLost, _tagged, brief  # noqa: E402
from apbv.serve.scheduler import replicas as replicas_module  # noqa: E402
from apbv.serve.scheduler.admission import Admission  # noqa: E402
from apbv.serve.scheduler.replicas import Replica, overall_status  # noqa: E402

RAY_TEXT = "1 worker(s) were killed due to the node running low on memory.\n" + "x" * 5000
"""The shape of Ray's own message: a first line, then KBs."""


class _Actor:
    """A rank's actor: ``ping.remote()`` gives a ref the patched ``ray.get`` answers for."""

    def __init__(self, rank: int):
        self.ping = SimpleNamespace(remote=lambda: rank)


class _Group(RankGroup):
    """A RankGroup over stand-in actors whose ranks are real idle processes (this node's):
    a rank's ping raises ``error`` once its process is gone; :meth:`rebuild` starts new ones."""

    def __init__(self, error: Exception):
        super().__init__(None, 2)
        self.error, self.rebuilds = error, 0
        self.procs: list[subprocess.Popen] = []
        self.start()

    def start(self) -> None:
        self.procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
        self.actors = [_Actor(r) for r in range(2)]
        self.pids = self.local_pids = [p.pid for p in self.procs]

    def get(self, rank: int, timeout: float | None = None) -> int:
        if self.procs[rank].poll() is not None:
            raise self.error
        return self.pids[rank]

    def rebuild(self) -> None:
        time.sleep(0.3)  # the model loads
        self.stop()
        self.start()
        self.rebuilds += 1

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("error, why", [
    (OutOfMemoryError(RAY_TEXT), "killed by Ray's out-of-memory monitor"),
    (ActorUnavailableError(RAY_TEXT, None), "unavailable"),
    (ActorDiedError(), "died"),
    (GetTimeoutError(RAY_TEXT), "did not answer within 5 s"),
])
def test_any_ray_error_of_a_ping_is_a_lost_rank_named_briefly(monkeypatch, error, why):
    group = RankGroup(None, 2)
    group.actors = [_Actor(0), _Actor(1)]

    def get(rank: int, timeout: float | None = None) -> int:
        if rank == 1:
            raise error
        return 100

    monkeypatch.setattr(group_module.ray, "get", get)
    assert group.unanswered() == {1: why}


@pytest.mark.parametrize("error, why", [
    (OutOfMemoryError(RAY_TEXT), "rank 1 killed by Ray's out-of-memory monitor"),
    (ActorUnavailableError(RAY_TEXT, None), "rank 1 unavailable"),
    (ActorDiedError(), "actor died"),
])
def test_a_rank_call_failing_with_a_ray_error_is_a_lost_rank(error, why):
    async def call() -> None:
        async def failing() -> None:
            raise error
        await _tagged(1, failing())

    with pytest.raises(RankLost) as exc:
        asyncio.run(call())
    message = str(exc.value)
    assert message.startswith(f"rank(s) 1 of the engine group were lost ({why}): "
                              f"{type(error).__name__}; the request failed"), message
    assert exc.value.ranks == [1] and len(message) < 200, message


def test_a_failure_is_one_short_line_for_the_client():
    text = brief(OutOfMemoryError(RAY_TEXT))
    assert text == ("OutOfMemoryError: 1 worker(s) were killed due to the node running low on "
                    "memory."), text
    long = brief(RuntimeError("y" * 5000))
    assert long == "RuntimeError: " + "y" * group_module.BRIEF_CHARS + "...", len(long)

    async def scenario() -> ClientError:  # a rank's error past the ranks: a 500, briefly
        failing = SimpleNamespace(pids=[], world_size=1)

        async def submit(op, on_token, cancel):
            raise RuntimeError(RAY_TEXT)

        failing.submit = submit
        replica = Replica(0, failing, Admission(4), Metrics(), lambda _: None)
        replica.status = "ready"
        worker = asyncio.ensure_future(replica.run())
        job = replica.admission.admit(SimpleNamespace(deadline_ms=None, downloaded=None,
                                                      request=SimpleNamespace()), {},
                                      max_tokens=1)
        try:
            await asyncio.wait_for(job.future, 5)
        except ClientError as exc:
            return exc
        finally:
            worker.cancel()
        pytest.fail("the failing job was answered")

    error = asyncio.run(scenario())
    assert error.status == 500 and error.message == \
        "RuntimeError: 1 worker(s) were killed due to the node running low on memory.", error


@pytest.mark.parametrize("error, why", [
    (OutOfMemoryError(RAY_TEXT), "rank 1 killed by Ray's out-of-memory monitor"),
    (ActorUnavailableError(RAY_TEXT, None), "rank 1 unavailable"),
])
def test_an_idle_replica_with_a_dead_rank_is_never_ready_until_rebuilt(monkeypatch, error,
                                                                        why):
    """No request: the rank's process is SIGKILLed; /health's pid check makes the replica
    ``degraded`` at once, the idle ping finds the rank lost (the Ray error named) and the group
    is rebuilt; the status is sampled every 5 ms meanwhile and is never ``ready``."""
    monkeypatch.setattr(replicas_module, "LIVENESS_POLL_S", 0.05)
    group = _Group(error)
    monkeypatch.setattr(group_module.ray, "get", group.get)

    async def scenario() -> tuple[list[str], list[str | None], float]:
        replica = Replica(0, group, Admission(4), Metrics(), lambda _: None)
        told: list[int] = []
        replica.on_lost.append(lambda r: told.append(r.generation))
        replica.status = "ready"
        worker = asyncio.ensure_future(replica.run())
        await asyncio.sleep(0.2)  # a few idle pings, every rank answering
        assert replica.status == "ready" and group.rebuilds == 0
        dead = group.pids[1]
        group.procs[1].send_signal(signal.SIGKILL)
        group.procs[1].wait()
        killed = time.monotonic()
        statuses, lost = [], []
        while group.rebuilds == 0 or replica.status != "ready":
            replica.check_pids()  # what /health does first
            statuses.append(overall_status([replica]))
            lost.append(replica.describe().get("lost"))
            assert time.monotonic() - killed < 5, statuses[-5:]
            await asyncio.sleep(0.005)
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
        assert told == [1] and replica.generation == 1 and dead not in group.pids
        assert replica.describe().get("lost") is None
        return statuses, lost, time.monotonic() - killed

    try:
        statuses, lost, took = asyncio.run(scenario())
    finally:
        group.stop()
    assert "ready" not in statuses and statuses[0] == "degraded", statuses[:3]
    assert group.rebuilds == 1 and took < 5, took
    assert why in lost, sorted(set(map(str, lost)))  # named while it rebuilt


def test_the_liveness_loop_takes_a_waiting_job_before_one_queued_meanwhile():
    """The worker waits for jobs with a timeout now (its idle pings): a job already waiting is
    still taken before a task woken by the last job's end can queue another, as a watch's
    round queues its next evaluation (which would go first: evaluations do) and so never let
    an append in between."""
    async def scenario() -> list[str]:
        ran: list[str] = []

        async def submit(op, on_token, cancel):
            ran.append(op.what)
            return SimpleNamespace()

        replica = Replica(0, SimpleNamespace(pids=[], world_size=1, submit=submit),
                          Admission(8), Metrics(), lambda _: None)
        replica.status = "ready"
        admission = replica.admission

        def admit(what: str, evaluates: float | None = None):
            return admission.admit(None, {}, op=SimpleNamespace(what=what), predicted_s=0.0,
                                   stream_id="s", evaluates=evaluates)

        first = admit("evaluation 1", evaluates=1.0)
        admit("append")
        first.future.add_done_callback(lambda _: admit("evaluation 2", evaluates=1.0))
        worker = asyncio.ensure_future(replica.run())
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(ran) == 3:
                break
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
        return ran

    assert asyncio.run(scenario()) == ["evaluation 1", "append", "evaluation 2"]
