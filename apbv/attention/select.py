"""Query-aware selection of the KV pairs a virtual block passes on (pure math, no communication).

Legend: Q query rows, T tokens of one block, Hq query heads, Hkv KV heads (G = Hq // Hkv query
heads per KV head), D head dim, C passing capacity (rows of the fixed-shape send buffer).

Score of key j under KV head h (DESIGN section 3), all in fp32:

    raw[j, h]    = k[j, h] . mean(q over the query rows and the G query heads of group h)
    pooled[j, h] = max(raw[j-2 .. j+2, h]), the window clipped to the block

The mean over the query rows commutes with the dot product, so one mean query vector per KV head
suffices. Each KV head keeps its own top-min(P, T) tokens, ranked by pooled score (higher
first), ties broken by the raw score (higher first), then by position (earlier first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

POOL_WIDTH = 5


def mean_query(q_query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """q_query (B=1, Q, Hq, D) -> the mean query vector of each KV head's group, (Hkv, D) fp32."""
    _, nq, hq, d = q_query.shape
    grouped = q_query[0].float().reshape(nq, num_kv_heads, hq // num_kv_heads, d)
    return grouped.mean(dim=(0, 2))


def block_scores(k_block: torch.Tensor, qbar: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw and pooled scores of one block's keys.

    Args:
        k_block: (T, Hkv, D) post-RoPE keys of the block.
        qbar: (Hkv, D) fp32 from :func:`mean_query`.

    Returns:
        raw, pooled: (T, Hkv) fp32.
    """
    raw = torch.einsum("thd,hd->th", k_block.float(), qbar)
    # max_pool1d pads with -inf, so the window never leaves the block.
    pooled = F.max_pool1d(raw.T.unsqueeze(0), POOL_WIDTH, stride=1, padding=POOL_WIDTH // 2)
    return raw, pooled[0].T


def select_tokens(raw: torch.Tensor, pooled: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` best tokens per KV head, in ascending position order.

    raw, pooled: (T, Hkv). Returns (count, Hkv) int64. The ranking is a lexicographic stable sort:
    position ascending, then raw descending, then pooled descending (the last sort decides first).
    """
    t = raw.shape[0]
    assert 0 <= count <= t, (count, t)
    if count == t:
        return torch.arange(t, device=raw.device).unsqueeze(1).expand(t, raw.shape[1])
    by_raw = torch.sort(raw, dim=0, descending=True, stable=True).indices
    by_pooled = torch.sort(pooled.gather(0, by_raw), dim=0, descending=True, stable=True).indices
    chosen = by_raw.gather(0, by_pooled[:count])
    return chosen.sort(dim=0).values


def pack_selection(
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    qbar: torch.Tensor,
    count: int,
    capacity: int,
) -> torch.Tensor:
    """The fixed-shape send buffer of one block: its ``count`` selected K and V rows per KV head.

    Args:
        k_block, v_block: (T, Hkv, D).
        qbar: (Hkv, D) fp32.
        count: tokens to select, min(P, T).
        capacity: rows of the buffer, the same on every rank (>= count).

    Returns:
        (2, C, Hkv, D) in k's dtype: [0] keys, [1] values; rows >= count are zero padding.
    """
    t, hkv, d = k_block.shape
    assert count <= capacity, (count, capacity)
    buf = k_block.new_zeros(2, capacity, hkv, d)
    if count == 0:
        return buf
    if count == t:  # the whole block passes: no scoring needed
        buf[0, :count], buf[1, :count] = k_block, v_block
        return buf
    idx = select_tokens(*block_scores(k_block, qbar), count)
    idx = idx.unsqueeze(-1).expand(count, hkv, d)
    buf[0, :count] = k_block.gather(0, idx)
    buf[1, :count] = v_block.gather(0, idx)
    return buf
