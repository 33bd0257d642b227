"""Bad input on gloo ranks: every rank raises a ValueError that names the problem, or, when
only one rank is wrong, the others fail within the collective timeout instead of hanging."""

from __future__ import annotations

import time

import pytest
import torch

from apbv import apbv_attention, make_plan
from apbv.distributed import DistInfo, RankFailure, spawn_local


def _bad_calls(info: DistInfo) -> list[str]:
    """Several bad calls, all ranks alike; returns each call's ValueError message."""
    plan = make_plan(100, 7, info.world_size)
    t = plan.local_len(info.rank)
    good = torch.randn(1, t, 4, 8), torch.randn(1, t, 2, 8), torch.randn(1, t, 2, 8)
    calls = [
        lambda: apbv_attention(*good, make_plan(100, 7, 3)),
        lambda: apbv_attention(good[0][:, 1:], good[1][:, 1:], good[2][:, 1:], plan),
        lambda: apbv_attention(good[0], torch.randn(1, t, 3, 8), torch.randn(1, t, 3, 8), plan),
        lambda: apbv_attention(*good, plan, softmax_scale=-1.0),
    ]
    messages = []
    for call in calls:
        try:
            call()
        except ValueError as exc:
            messages.append(str(exc))
        else:
            messages.append("no error")
    # The group still works after the rejected calls: nothing was left half-started.
    apbv_attention(*good, plan)
    return messages


def test_every_rank_names_the_problem() -> None:
    per_rank = spawn_local(_bad_calls, 2, timeout_s=120, collective_timeout_s=30)
    plan = make_plan(100, 7, 2)
    for rank, messages in enumerate(per_rank):
        t = plan.local_len(rank)
        assert "plan is for world_size=3 but the process group has 2 rank(s)" in messages[0]
        assert f"rank {rank} got {t - 1} tokens but the plan gives it {t}" in messages[1]
        assert "query heads (4) must be a multiple of KV heads (3)" in messages[2]
        assert "softmax_scale must be a positive finite number, got -1.0" in messages[3]


def _one_rank_wrong(info: DistInfo) -> None:
    plan = make_plan(100, 7, info.world_size)
    t = plan.local_len(info.rank) - (1 if info.rank == 1 else 0)
    apbv_attention(torch.randn(1, t, 4, 8), torch.randn(1, t, 2, 8), torch.randn(1, t, 2, 8), plan)


def test_one_bad_rank_does_not_hang_the_others() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn_local(_one_rank_wrong, 2, timeout_s=120, collective_timeout_s=10)
    elapsed = time.monotonic() - start
    errors = info.value.errors
    t = make_plan(100, 7, 2).local_len(1)
    assert errors[1][0] == "ValueError", errors[1]
    assert f"rank 1 got {t - 1} tokens but the plan gives it {t}" in errors[1][1]
    assert 0 in errors, "rank 0 must report its failed collective, not hang"
    assert errors[0][0] != "Timeout", errors[0]
    assert elapsed < 60, f"took {elapsed:.0f} s"
