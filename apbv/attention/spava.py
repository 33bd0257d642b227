"""APB-V ("Spava") prefill attention of one layer on this rank's ZigZag shard.

Legend: T local tokens = A + T1 + T2 + Q (anchor, block r, block 2H-1-r, query; see
:mod:`apbv.plan`), Hq query heads, Hkv KV heads, D head dim, C passing capacity, H ranks.

Semantics (DESIGN section 3): the result equals dense masked attention over the prompt in global
order where

- an anchor token sees the anchor tokens at or before it;
- a token of virtual block v sees the whole anchor, the tokens of block v at or before it, and
  Sel(u) for every earlier block u, Sel(u) being the top-P tokens of u under the query-aware
  score (:mod:`apbv.attention.select`), chosen per KV head;
- a query token sees every context token and the query tokens at or before it (exact: H
  partial attentions, one per rank over the keys it owns, merged by log-sum-exp).

Schedule per call on rank r (DESIGN section 4): score -> select block r -> start its all-gather
-> select block 2H-1-r -> start its all-gather -> query partial -> start its all-gather ->
anchor rows -> wait 1 -> block r rows -> wait 2 -> block 2H-1-r rows -> wait query partials
-> merge. The second block's transfer hides behind the first block's attention. Every send
buffer has a fixed shape on all ranks (C rows, zero padded); valid lengths come from the plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from apbv import comm
from apbv.attention import kernels
from apbv.attention.merge import merge_packed, merge_partials, pack_partial
from apbv.attention.select import mean_query, pack_selection
from apbv.plan import Plan

Partial = tuple[torch.Tensor, torch.Tensor]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], Partial]


def apbv_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Plan,
    *,
    overlap: bool = True,
    group: dist.ProcessGroup | None = None,
    softmax_scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """APB-V attention over rank-local, post-RoPE q/k/v.

    Args:
        q: (1, T, Hq, D), this rank's tokens in local order [anchor | its blocks | query]
            (ZigZag: [anchor | block r | block 2H-1-r | query]).
        k, v: (1, T, Hkv, D), Hq a multiple of Hkv.
        plan: the layout, the same on every rank; ``plan.world_size`` must match the group.
            Exactness is the plan's: ``plan.exact()`` passes every token, and the result is
            then ordinary causal attention (on one rank: one causal kernel call).
        overlap: False waits on every collective as soon as it starts (the ``no_overlap``
            ablation); the result is the same.
        group: the process group of the H ranks; None for the default group, or a single
            rank when no process group is initialised.
        softmax_scale: default D ** -0.5.
        backend: attention kernel backend (see :mod:`apbv.attention.kernels`).

    Returns:
        out (1, T, Hq, D) in q's dtype, local order.
    """
    rank, world = comm.rank_and_size(group)
    _check_inputs(q, k, v, plan, rank, world, softmax_scale)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    if world == 1 and plan.is_exact:  # one rank: local order is global order, all keys seen
        return kernels.attention(q, k, v, causal=True, scale=scale, backend=backend)[0]

    def attend(qq: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, causal: bool) -> Partial:
        return kernels.attention(qq, kk, vv, causal=causal, scale=scale, backend=backend)

    def start(x: torch.Tensor) -> comm.PendingGather:
        pending = comm.start_all_gather(x, group)
        if not overlap:
            pending.wait()
        return pending

    ranges = plan.local_ranges(rank)
    anchor_end, block_ranges, (qs, qe) = ranges[0][1], ranges[1:-1], ranges[-1]
    mine = plan.rank_blocks(rank)

    # 1. Query-aware selection of each local block; their all-gathers start at once.
    #    gathers[j] -> (H, 2, C, Hkv, D): [i] = the selection of rank i's j-th block.
    qbar = mean_query(q[:, qs:qe], k.shape[2])
    gathers = [
        start(pack_selection(k[0, s:e], v[0, s:e], qbar, plan.selected_len(b),
                             plan.passing_capacity))
        for b, (s, e) in zip(mine, block_ranges)
    ]

    # 2. This rank's share of the exact query attention: its anchor slice and its blocks
    #    (non-causal), plus on rank 0 the query keys themselves (bottom-right causal).
    q_query = q[:, qs:qe]
    a0, a1 = plan.anchor_share(rank)
    blocks_start, blocks_end = plan.local_blocks_range(rank)
    key_end = qe if rank == 0 else blocks_end
    partials = [
        attend(q_query, k[:, a0:a1], v[:, a0:a1], False),
        attend(q_query, k[:, blocks_start:key_end], v[:, blocks_start:key_end], rank == 0),
    ]
    gather_query = start(pack_partial(*merge_partials(*zip(*partials))))

    out = torch.empty_like(q)
    # 3. Anchor rows: causal over the anchor only (identical on every rank).
    out[:, :anchor_end] = attend(
        q[:, :anchor_end], k[:, :anchor_end], v[:, :anchor_end], True
    )[0]

    # 4. Each local block: the anchor, Sel(u) of every earlier block u, and itself (causal).
    #    Waiting only on the gathers that hold earlier blocks lets the ZigZag second block's
    #    transfer hide behind the first block's attention.
    for block, rows in zip(mine, block_ranges):
        passing = []
        for u in range(block):
            owner, slot = plan.block_slot(u)
            passing.append((gathers[slot].wait()[owner], plan.selected_len(u)))
        out[:, rows[0]:rows[1]] = _block_attention(q, k, v, rows, anchor_end, passing, attend)

    # 5. The exact query rows: merge the H partials.
    out[:, qs:qe] = merge_packed(gather_query.wait())[0]  # gathered: (H, Q, Hq, D + 1)
    for pending in gathers:  # complete every collective before its buffers go
        pending.wait()
    return out


def _block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: tuple[int, int],
    anchor_end: int,
    passing: list[tuple[torch.Tensor, int]],
    attend: Attend,
) -> torch.Tensor:
    """Rows of one virtual block: non-causal over [passing | anchor], causal over the block.

    q/k/v: (1, T, H, D) local; rows: the block's local [start, end); passing: (buffer
    (2, C, Hkv, D), valid rows) per earlier block. Returns (1, rows, Hq, D) in q's dtype.
    """
    start, end = rows
    if start == end:
        return q[:, start:end]
    context_k = torch.cat([buf[0, :n] for buf, n in passing] + [k[0, :anchor_end]])
    context_v = torch.cat([buf[1, :n] for buf, n in passing] + [v[0, :anchor_end]])
    q_rows = q[:, start:end]
    out, _ = merge_partials(
        *zip(
            attend(q_rows, context_k.unsqueeze(0), context_v.unsqueeze(0), False),
            attend(q_rows, k[:, start:end], v[:, start:end], True),
        )
    )
    return out.to(q.dtype)


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Plan,
    rank: int,
    world: int,
    softmax_scale: float | None,
) -> None:
    if softmax_scale is not None and not (
        isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale)
        and softmax_scale > 0
    ):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    if plan.world_size != world:
        raise ValueError(
            f"the plan is for world_size={plan.world_size} but the process group has "
            f"{world} rank(s)"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (B, T, heads, D), got shape {tuple(t.shape)}")
    if q.shape[0] != 1:
        raise ValueError(f"batch size must be 1, got q of shape {tuple(q.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree on batch, tokens and "
            "head dim"
        )
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(
            f"query heads ({q.shape[2]}) must be a multiple of KV heads ({k.shape[2]})"
        )
    if q.dtype != k.dtype or q.dtype != v.dtype or q.device != k.device or q.device != v.device:
        raise ValueError(
            f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on "
            f"{q.device}/{k.device}/{v.device}"
        )
    expected = plan.local_len(rank)
    if q.shape[1] != expected:
        ranges = plan.local_ranges(rank)
        blocks = "+".join(str(e - s) for s, e in ranges[1:-1])
        raise ValueError(
            f"rank {rank} got {q.shape[1]} tokens but the plan gives it {expected} "
            f"(anchor {ranges[0][1]} + blocks {blocks} + query {plan.query_len})"
        )
