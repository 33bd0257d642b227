"""init_distributed takes this rank's device from its caller (a Ray actor's GPU, gloo ranks all
on one GPU for a check) instead of deriving cuda:LOCAL_RANK; nothing here touches CUDA."""

from __future__ import annotations

import pytest
import torch

from apbv import distributed


@pytest.fixture
def one_rank(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    made: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: made.append(torch.device(d)))
    return made


def test_gloo_takes_the_callers_device(one_rank, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")  # a GPU that a Ray actor does not see
    info = distributed.init_distributed(backend="gloo", device="cuda:0")
    assert info.device == torch.device("cuda", 0) and info.backend is None
    assert one_rank == [torch.device("cuda", 0)]  # made current in the calling thread


def test_gloo_defaults_to_the_cpu(one_rank):
    info = distributed.init_distributed(backend="gloo")
    assert info.device == torch.device("cpu") and one_rank == []


def test_nccl_refuses_a_cpu_device(one_rank, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="nccl backend needs a CUDA device"):
        distributed.init_distributed(backend="nccl", device="cpu")
    info = distributed.init_distributed(backend="nccl", device="cuda:1")
    assert info.device == torch.device("cuda", 1)
