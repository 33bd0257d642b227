"""The start-up barrier (apbv.comm.startup_barrier, apbv.distributed.ranks_ready): every rank
waits through the store until all have arrived, the waiting ranks name the late ones while
they wait, and past the start-up timeout each raises naming the missing ranks and the setting.
Ranks are threads sharing one in-memory store; delays are fractions of a second."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from apbv import comm, distributed
from apbv.config import load_config


def _run_ranks(world: int, delays: dict[int, float | None], timeout_s: float,
               ) -> tuple[dict[int, list[str]], dict[int, BaseException], dict[int, float]]:
    """Each rank (a thread) sleeps its delay (None: never arrives), then waits at the barrier:
    (log lines, errors, the time each left the barrier) by rank."""
    store = dist.HashStore()
    logs: dict[int, list[str]] = {r: [] for r in range(world)}
    errors: dict[int, BaseException] = {}
    left: dict[int, float] = {}

    def rank_main(rank: int) -> None:
        time.sleep(delays.get(rank) or 0.0)
        try:
            comm.startup_barrier(store, "loaded", rank, world, timeout_s, report_every_s=0.15,
                                 poll_s=0.01, log=logs[rank].append)
        except BaseException as exc:  # recorded for the test to check
            errors[rank] = exc
        left[rank] = time.monotonic()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)
               if delays.get(r, 0.0) is not None]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank never left the barrier"
    return logs, errors, left


def test_waiting_ranks_name_the_late_rank_and_all_leave_together() -> None:
    start = time.monotonic()
    logs, errors, left = _run_ranks(3, {2: 0.6}, timeout_s=10.0)
    assert errors == {}
    # Nobody leaves before the late rank arrives, and all leave soon after it.
    assert min(left.values()) - start >= 0.6, f"left after {min(left.values()) - start:.2f} s"
    assert max(left.values()) - start < 3.0, f"left after {max(left.values()) - start:.2f} s"
    for rank in (0, 1):
        assert logs[rank], f"rank {rank} logged nothing while rank 2 was late"
        assert all(f"rank {rank}: waiting for rank(s) 2 at the start-up point 'loaded' "
                   "(2/3 there, " in line for line in logs[rank]), logs[rank]
    assert logs[2] == [], logs[2]  # the late rank found everyone there


def test_timeout_names_the_missing_ranks_and_the_setting() -> None:
    start = time.monotonic()
    logs, errors, _ = _run_ranks(4, {1: None, 3: None}, timeout_s=0.5)
    waited = time.monotonic() - start
    assert set(errors) == {0, 2}
    for rank, exc in errors.items():
        assert isinstance(exc, comm.StartupTimeout) and exc.late == [1, 3]
        assert str(exc).startswith(f"rank {rank}: rank(s) 1, 3 did not reach the start-up "
                                   "point 'loaded' within parallel.startup_timeout_s = 0.5 s")
    assert 0.5 <= waited < 5.0, f"gave up after {waited:.2f} s"
    assert any("rank(s) 1, 3" in line for line in logs[0]), logs[0]


def test_a_rank_that_failed_ends_the_others_wait_at_once() -> None:
    store = dist.HashStore()
    errors: dict[int, BaseException] = {}

    def waiting(rank: int) -> None:
        try:
            comm.startup_barrier(store, "loaded", rank, 3, 30.0, poll_s=0.01, log=print)
        except BaseException as exc:  # recorded for the test to check
            errors[rank] = exc

    threads = [threading.Thread(target=waiting, args=(r,)) for r in (0, 2)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    start = time.monotonic()
    comm.startup_barrier(store, "loaded", 1, 3, 30.0, failed="OSError: a shard is missing")
    for t in threads:
        t.join(timeout=10)
    stopped = time.monotonic() - start
    assert stopped < 2.0, f"the waiting ranks took {stopped:.2f} s to stop (timeout 30 s)"
    for rank in (0, 2):
        assert isinstance(errors[rank], comm.StartupFailed), errors
        assert str(errors[rank]) == (f"rank {rank}: stopped waiting at the start-up point "
                                     "'loaded': rank 1: OSError: a shard is missing")


def test_one_rank_passes_at_once() -> None:
    start = time.monotonic()
    comm.startup_barrier(dist.HashStore(), "loaded", 0, 1, 0.01)
    assert time.monotonic() - start < 0.5


def test_ranks_ready_holds_the_named_rank_back_and_uses_fresh_keys(monkeypatch) -> None:
    store = dist.HashStore()
    store.set("apbv/startup/1-model loaded/1", "1")  # rank 1 already there at the first point
    monkeypatch.setattr(distributed, "_startup", (store, 0, 2, 0.3))
    monkeypatch.setattr(distributed, "_points", {})
    monkeypatch.setenv(distributed.LATE_RANK_ENV, "0:0.4")
    start = time.monotonic()
    distributed.ranks_ready("model loaded")
    held = time.monotonic() - start
    assert 0.4 <= held < 2.0, f"rank 0 was held {held:.2f} s, expected 0.4 s"
    monkeypatch.setenv(distributed.LATE_RANK_ENV, "1:30")  # another rank's hold: none here
    with pytest.raises(comm.StartupTimeout, match=r"rank\(s\) 1 did not reach the start-up "
                       r"point '2-model loaded'"):
        distributed.ranks_ready("model loaded")  # a second point: rank 1's old key won't do


def test_ranks_ready_posts_a_failure_without_waiting(monkeypatch) -> None:
    store = dist.HashStore()
    monkeypatch.setattr(distributed, "_startup", (store, 1, 2, 30.0))
    monkeypatch.setattr(distributed, "_points", {})
    monkeypatch.setenv(distributed.LATE_RANK_ENV, "1:30")  # no hold for a rank that failed
    start = time.monotonic()
    distributed.ranks_ready("model loaded", failed=MemoryError("out of memory"))
    assert time.monotonic() - start < 1.0
    assert store.get("apbv/startup/1-model loaded/failed") == b"rank 1: MemoryError: out of memory"


@pytest.mark.parametrize("value", ["0", "-5", "nan", "100000"])
def test_startup_timeout_setting_is_checked(value: str) -> None:
    with pytest.raises(ValueError, match=r"parallel\.startup_timeout_s must be"):
        load_config("tiny_cpu", [f"parallel.startup_timeout_s={value}"])
    assert load_config("tiny_cpu").parallel.startup_timeout_s == 1800.0


def test_subgroups_wait_only_for_their_own_ranks() -> None:
    """Sequence-parallel groups of one job (eval --groups, tests' worlds of ranks [0, k)) load
    their engines independently: ranks 1 and 3 meet while ranks 0 and 2 never come, and the
    late one is named by its global rank."""
    store = dist.HashStore()
    logs: dict[int, list[str]] = {1: [], 3: []}
    errors: dict[int, BaseException] = {}

    def rank_main(rank: int, delay: float) -> None:
        time.sleep(delay)
        try:
            comm.startup_barrier(store, "ranks 1,3 1-loaded", rank, 4, 5.0, report_every_s=0.1,
                                 poll_s=0.01, log=logs[rank].append, ranks=[1, 3])
        except BaseException as exc:  # recorded for the test to check
            errors[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(1, 0.0)),
               threading.Thread(target=rank_main, args=(3, 0.4))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads), "a subgroup waited for ranks outside it"
    assert errors == {}, errors
    assert logs[1] and all("waiting for rank(s) 3 at" in line for line in logs[1]), logs[1]
    assert logs[3] == [], logs[3]
