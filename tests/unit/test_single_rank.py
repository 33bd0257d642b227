"""The APB-V op on one rank (no process group) against the dense-mask oracle; the oracle itself."""

from __future__ import annotations

import pytest
import torch

from apbv import apbv_attention
from apbv.cost import full_pairs, rank_pairs
from apbv.layout import shard
from apbv.plan import make_plan
from tests.cases import CASES, Case, check
from tests.oracle import causal_attention, oracle_attention, visible_keys


@pytest.mark.parametrize("case", CASES, ids=str)
def test_single_rank_matches_oracle(case: Case) -> None:
    plan = case.plan(1)
    q, k, v = case.inputs()
    out = apbv_attention(shard(q, plan, 0), shard(k, plan, 0), shard(v, plan, 0), plan,
                         overlap=case.overlap)
    assert out.dtype == q.dtype and out.shape == q.shape
    problem = check(case, plan, out)
    assert problem is None, problem


def test_oracle_with_infinite_passing_is_causal() -> None:
    """Guard the oracle: with P >= every block it must be ordinary causal attention."""
    case = Case(90, 6, anchor_len=5, passing_len=10**6)
    q, k, v = case.inputs()
    for world_size in (1, 2, 3):
        got = oracle_attention(q, k, v, case.plan(world_size))
        err = (got - causal_attention(q, k, v)).abs().max().item()
        assert err <= 1e-12, f"fp64 oracle vs fp64 causal: {err:.2e}"


def test_oracle_masks_are_not_causal_when_passing_is_small() -> None:
    case = Case(90, 6, anchor_len=5, passing_len=2)
    q, k, v = case.inputs()
    visible = visible_keys(q, k, case.plan(2))
    causal = torch.ones(96, 96, dtype=torch.bool).tril()
    assert not (visible & ~causal).any()  # never sees the future
    assert (causal & ~visible).any()  # and really drops keys


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_counted_pairs_match_oracle_masks(world_size: int) -> None:
    """apbv.cost counts exactly the pairs the oracle's mask allows (anchor rows on every rank)."""
    case = Case(97, 5, anchor_len=6, passing_len=4, kv_heads=1, heads=1)
    q, k, v = case.inputs()
    for plan in (case.plan(world_size), case.plan(world_size).exact()):
        visible = int(visible_keys(q, k, plan)[0].sum())
        counted = sum(rank_pairs(plan, r) for r in range(world_size))
        anchor_repeats = (world_size - 1) * plan.anchor_len * (plan.anchor_len + 1) // 2
        assert counted == visible + anchor_repeats
    assert full_pairs(make_plan(97, 5, 1)) == 102 * 103 // 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(scale=float("nan")), "softmax_scale must be a positive finite number, got nan"),
        (dict(tokens=-1), "rank 0 got 106 tokens but the plan gives it 107 (anchor 2 + blocks"),
        (dict(q_tokens=-1), "q (1, 106, 4, 8) and k/v (1, 107, 2, 8) must agree"),
        (dict(kv_heads=3), "query heads (4) must be a multiple of KV heads (3)"),
        (dict(batch=2), "batch size must be 1"),
        (dict(v_tokens=-1), "k and v shapes differ"),
        (dict(dtype=torch.float64), "q, k, v must share dtype and device"),
        (dict(world_size=2), "the plan is for world_size=2 but the process group has 1 rank(s)"),
        (dict(q_dims=3), "q must be (B, T, heads, D), got shape (107, 4, 8)"),
    ],
)
def test_bad_input_raises_value_error(change: dict, message: str) -> None:
    plan = make_plan(100, 7, change.get("world_size", 1))
    t = plan.local_len(0) + change.get("tokens", 0)
    hkv = change.get("kv_heads", 2)
    q = torch.randn(change.get("batch", 1), t + change.get("q_tokens", 0), 4, 8)
    k = torch.randn(change.get("batch", 1), t, hkv, 8, dtype=change.get("dtype", torch.float32))
    v = torch.randn(change.get("batch", 1), t + change.get("v_tokens", 0), hkv, 8)
    if change.get("q_dims") == 3:
        q = q[0]
    with pytest.raises(ValueError) as info:
        apbv_attention(q, k, v, plan, softmax_scale=change.get("scale"))
    assert message in str(info.value)
