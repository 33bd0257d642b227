"""Counted attention work (pure): query-key pairs each rank scores under a plan.

FLOPs of softmax attention = 4 * D * Hq * pairs (QK^T and PV, a multiply-add each). Pairs are
counted exactly as the op computes them (causal squares count n(n+1)/2).
"""

from __future__ import annotations

from apbv.plan import Plan


def _causal(n: int) -> int:
    return n * (n + 1) // 2


def rank_pairs(plan: Plan, rank: int) -> int:
    """Query-key pairs rank ``rank`` scores in one APB-V layer (use ``plan.exact()`` for exact)."""
    a, q = plan.anchor_len, plan.query_len
    pairs = _causal(a)
    blocks_len = 0
    for block in plan.rank_blocks(rank):
        n = plan.block_len(block)
        passed = sum(plan.selected_len(u) for u in range(block))
        pairs += n * (a + passed) + _causal(n)
        blocks_len += n
    a0, a1 = plan.anchor_share(rank)
    pairs += q * (a1 - a0 + blocks_len) + (_causal(q) if rank == 0 else 0)
    return pairs


def full_pairs(plan: Plan) -> int:
    """Pairs of ordinary causal attention over the whole prompt in one process."""
    return _causal(plan.total_len)


def attention_flops(pairs: int, num_heads: int, head_dim: int) -> float:
    return 4.0 * head_dim * num_heads * pairs
