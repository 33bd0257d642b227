"""Frame-parallel vision encoding and the transfer of video embeddings to the ranks that use them.

Rank r runs the vision tower on its contiguous share of temporal patches only; this is exact
because Qwen2.5-VL's vision tower never attends across temporal patches. Its output rows are
the video tokens [p0 * S, p1 * S) (S = tokens per temporal patch), in video order (with
per-token pruning, the rows of its patches' kept tokens: a contiguous range [a, b) of the
prompt's video tokens all the same).

Those embeddings are then needed where the tokens live in the ZigZag layout: the anchor on every
rank, each block on its owner. :func:`apbv.ownership.embedding_routes` works out, purely from
the plan, which video tokens each rank sends to each other rank, and :func:`route_embeddings`
moves exactly those with one all-to-all - less than an all-gather of every embedding to every
rank, which moves (H - 1) / H of all video embeddings to each rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from apbv import comm
from apbv.ownership import _count
from apbv.plan import Range


def route_embeddings(
    local_embeds: torch.Tensor,
    routes: list[list[list[Range]]],
    encoded: Range,
    rank: int,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Move video embeddings to the ranks that need them.

    Args:
        local_embeds: (n_local, hidden), the rows this rank encoded: the video tokens
            ``encoded`` [a, b) (a = p0 * S without pruning).
        routes: from :func:`apbv.ownership.token_routes` (or ``embedding_routes``),
            identical on every rank.

    Returns:
        (m, hidden): the embeddings of this rank's video tokens, in global (= local) order.
    """
    world = len(routes)
    base = encoded[0]
    assert len(local_embeds) == encoded[1] - encoded[0], (local_embeds.shape, encoded)
    send = [torch.cat([local_embeds[s - base : e - base] for s, e in routes[rank][dst]])
            if routes[rank][dst] else local_embeds[:0] for dst in range(world)]
    send_counts = [t.shape[0] for t in send]
    recv_counts = [_count(routes[src][rank]) for src in range(world)]
    return comm.all_to_all_rows(torch.cat(send), send_counts, recv_counts, group)
