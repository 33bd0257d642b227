"""Counted attention work (pure): query-key pairs each rank scores under a plan.

FLOPs of softmax attention = 4 * D * Hq * pairs (QK^T and PV, a multiply-add each). Pairs are
counted exactly as the op computes them (causal squares count n(n+1)/2).
"""

from __future__ import annotations

import json
from pathlib import Path

from apbv.kvcache import owned_local_index
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


def memory_estimate(plan: Plan, model_dir: str | Path, *, dtype_bytes: int = 2) -> list[str]:
    """Per-rank memory of one request, from the checkpoint's config.json only (no weights)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{str(path)!r} not found")
    config = json.loads(path.read_text())
    text = config.get("text_config", config)
    layers, hidden = text["num_hidden_layers"], text["hidden_size"]
    heads, kv_heads = text["num_attention_heads"], text["num_key_value_heads"]
    head_dim = text.get("head_dim") or hidden // heads
    kv_token = 2 * layers * kv_heads * head_dim * dtype_bytes
    gib = 1024**3
    lines = [f"memory per rank ({layers} layers, {kv_heads} KV heads x {head_dim}, "
             f"{dtype_bytes} bytes per element):"]
    for rank in range(plan.world_size):
        cached = len(owned_local_index(plan, rank))
        local = plan.local_len(rank)
        passing = 2 * 2 * plan.world_size * plan.passing_capacity * kv_heads * head_dim
        lines.append(
            f"  rank {rank}: prompt KV cache {cached * kv_token / gib:.3f} GiB ({cached} tokens), "
            f"hidden states {local * hidden * dtype_bytes / gib:.3f} GiB ({local} tokens), "
            f"passing buffers {passing * dtype_bytes / gib:.4f} GiB per layer"
        )
    return lines
