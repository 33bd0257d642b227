"""apbv.layout: shard/unshard round trips for every H in 1..8 on ids, embeddings, 3-D positions."""

from __future__ import annotations

import pytest
import torch

from apbv.layout import shard, unshard
from apbv.plan import make_plan


@pytest.mark.parametrize("world_size", range(1, 9))
@pytest.mark.parametrize(("context_len", "query_len"), [(1, 1), (7, 2), (33, 5), (1000, 17)])
def test_round_trip_ids_embeddings_positions(world_size: int, context_len: int, query_len: int):
    plan = make_plan(context_len, query_len, world_size)
    length = plan.total_len
    ids = torch.arange(length).unsqueeze(0)  # (B, L): token i is i
    embeds = torch.randn(1, length, 3)
    positions = torch.randint(0, 50, (3, 1, length))  # M-RoPE ids, not monotone
    for x, dim in ((ids, 1), (embeds, 1), (positions, 2)):
        locals_ = [shard(x, plan, r, dim=dim) for r in range(world_size)]
        assert [t.shape[dim] for t in locals_] == [plan.local_len(r) for r in range(world_size)]
        assert torch.equal(unshard(locals_, plan, dim=dim), x)


@pytest.mark.parametrize("world_size", range(1, 9))
def test_local_order_and_ownership(world_size: int) -> None:
    plan = make_plan(501, 9, world_size, anchor_len=13)
    ids = torch.arange(plan.total_len).unsqueeze(0)
    seen = []
    for rank in range(world_size):
        local = shard(ids, plan, rank)[0].tolist()
        expected = []
        for start, end in plan.global_ranges(rank):
            expected += list(range(start, end))
        assert local == expected  # [anchor | block r | block 2H-1-r | query]
        assert local == sorted(local)  # global order is preserved on every rank
        (_, a), (s1, _), (_, e2), _ = plan.local_ranges(rank)
        assert local[:a] == list(range(13))
        seen += local[s1:e2]
    # Each context token after the anchor lives on exactly one rank.
    assert sorted(seen) == list(range(13, 501))


def test_errors_name_the_problem() -> None:
    plan = make_plan(100, 4, 2)
    with pytest.raises(ValueError, match="tensor has 103 tokens along dim 1, but the plan has 104"):
        shard(torch.zeros(1, 103), plan, 0)
    locals_ = [shard(torch.zeros(1, 104), plan, r) for r in range(2)]
    with pytest.raises(ValueError, match="expected 2 local tensors, got 1"):
        unshard(locals_[:1], plan)
    with pytest.raises(ValueError, match="rank 1's tensor has"):
        unshard([locals_[0], locals_[1][:, :-1]], plan)
