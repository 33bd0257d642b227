"""Memory of one request per rank."""

from __future__ import annotations

from apbv.cost.work import ModelDims
from apbv.engine.kvcache import owned_local_index
from apbv.plan import Plan


def memory_estimate(plan: Plan, dims: ModelDims, *, dtype_bytes: int = 2) -> list[str]:
    """Per-rank memory of one request, from the model's sizes only (no weights)."""
    layers, hidden, kv_heads, head_dim = dims.layers, dims.hidden, dims.kv_heads, dims.head_dim
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
