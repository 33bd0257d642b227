"""Frame-parallel vision encoding and the transfer of video embeddings to the ranks that use them.

Rank r runs the vision tower on its contiguous share of temporal patches only; this is exact
because Qwen2.5-VL's vision tower never attends across temporal patches. Its output rows are
the video tokens [p0 * S, p1 * S) (S = tokens per temporal patch), in video order.

Those embeddings are then needed where the tokens live in the ZigZag layout: the anchor on every
rank, each block on its owner. :func:`embedding_routes` works out, purely from the plan, which
video tokens each rank sends to each other rank, and :func:`route_embeddings` moves exactly
those with one all-to-all - less than an all-gather of every embedding to every rank, which
moves (H - 1) / H of all video embeddings to each rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from apbv import comm
from apbv.plan import Plan, Range


@dataclass(frozen=True)
class VideoSpan:
    """Where the video's placeholder tokens sit in the global prompt."""

    start: int
    """Global position of the first video token."""
    num_tokens: int
    tokens_per_patch: int
    """LLM tokens per temporal patch: (h / merge) * (w / merge)."""


def _intersect(a: Range, b: Range) -> Range | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def needed_video_tokens(plan: Plan, span: VideoSpan, rank: int) -> list[Range]:
    """Video-token index ranges (0-based within the video) whose embeddings ``rank`` needs."""
    video = (span.start, span.start + span.num_tokens)
    out = []
    for piece in plan.global_ranges(rank):
        hit = _intersect(piece, video)
        if hit:
            out.append((hit[0] - span.start, hit[1] - span.start))
    return out


def embedding_routes(
    plan: Plan, span: VideoSpan, patch_ranges: list[Range]
) -> list[list[list[Range]]]:
    """routes[src][dst]: the video-token ranges rank ``src`` encodes and rank ``dst`` needs."""
    routes = []
    for p0, p1 in patch_ranges:
        encoded = (p0 * span.tokens_per_patch, p1 * span.tokens_per_patch)
        routes.append([
            [hit for need in needed_video_tokens(plan, span, dst)
             if (hit := _intersect(need, encoded))]
            for dst in range(plan.world_size)
        ])
    return routes


def _count(ranges: list[Range]) -> int:
    return sum(e - s for s, e in ranges)


def transfer_bytes(
    routes: list[list[list[Range]]], num_tokens: int, row_bytes: int
) -> tuple[int, int]:
    """(bytes our routing moves between ranks, bytes an all-gather of everything would move).

    An all-gather hands every rank the rows it did not encode: (H - 1) * num_tokens rows.
    """
    world = len(routes)
    moved = sum(_count(routes[s][d]) for s in range(world) for d in range(world) if s != d)
    return moved * row_bytes, (world - 1) * num_tokens * row_bytes


def route_embeddings(
    local_embeds: torch.Tensor,
    routes: list[list[list[Range]]],
    patch_range: Range,
    tokens_per_patch: int,
    rank: int,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Move video embeddings to the ranks that need them.

    Args:
        local_embeds: (n_local, hidden), the rows this rank encoded (video tokens
            [p0 * S, p1 * S)).
        routes: from :func:`embedding_routes`, identical on every rank.

    Returns:
        (m, hidden): the embeddings of this rank's video tokens, in global (= local) order.
    """
    world = len(routes)
    base = patch_range[0] * tokens_per_patch
    send = [torch.cat([local_embeds[s - base : e - base] for s, e in routes[rank][dst]])
            if routes[rank][dst] else local_embeds[:0] for dst in range(world)]
    send_counts = [t.shape[0] for t in send]
    recv_counts = [_count(routes[src][rank]) for src in range(world)]
    return comm.all_to_all_rows(torch.cat(send), send_counts, recv_counts, group)
