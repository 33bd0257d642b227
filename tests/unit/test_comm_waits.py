"""How apbv.comm waits for its async collectives: bounded on gloo, without a CPU-side timeout on
NCCL (where ``wait(timeout=...)`` blocks the CPU thread until the collective completes). The
collectives are replaced by fakes that hand back a work object recording its wait."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from apbv import comm


class FakeWork:
    def __init__(self) -> None:
        self.waits: list[dict] = []

    def wait(self, **kwargs) -> bool:
        self.waits.append(kwargs)
        return True


@pytest.fixture
def fake_group(monkeypatch):
    """A 2-rank world of the given backend whose async collectives return a FakeWork."""
    works: list[FakeWork] = []

    def started(*args, **kwargs) -> FakeWork:
        assert kwargs.get("async_op") is True
        works.append(FakeWork())
        return works[-1]

    def use(backend: str) -> list[FakeWork]:
        monkeypatch.setattr(comm, "is_distributed", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
        monkeypatch.setattr(comm, "_all_gather_single", started)
        monkeypatch.setattr(dist, "all_to_all_single", started)
        monkeypatch.setattr(dist, "broadcast", started)
        return works

    return use


def _every_waiting_collective() -> None:
    x = torch.zeros(4, 3)
    comm.start_all_gather(x).wait()
    comm.all_gather(x)
    comm.all_to_all_rows(x, [2, 2], [2, 2])
    comm.broadcast(x, src=0)


def test_nccl_waits_without_a_cpu_timeout(fake_group):
    works = fake_group("nccl")
    _every_waiting_collective()
    assert len(works) == 4
    assert [w.waits for w in works] == [[{}]] * 4, \
        "on NCCL every collective must be waited exactly once, with no timeout"


def test_gloo_waits_are_bounded(fake_group):
    comm.set_timeout(7.0)
    try:
        works = fake_group("gloo")
        _every_waiting_collective()
    finally:
        comm.set_timeout(600.0)
    assert len(works) == 4
    assert [w.waits for w in works] == [[{"timeout": timedelta(seconds=7.0)}]] * 4
