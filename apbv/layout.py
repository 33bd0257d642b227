"""ZigZag sharding of any per-token tensor: token ids, embeddings, 3-D position ids, outputs.

Rank r's local tensor is [anchor | its blocks | query] along ``dim``, for ZigZag
[anchor | block r | block 2H-1-r | query] (see :mod:`apbv.plan`). The same index map is used
for every tensor, so positions always travel with their tokens; masks are never derived from
positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from apbv.plan import Plan


def shard(x: torch.Tensor, plan: Plan, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s local slice of ``x``, whose ``dim`` runs over the N + Q prompt tokens.

    Example: ids (B, N+Q) -> (B, T_local); positions (3, B, N+Q) with dim=2 -> (3, B, T_local).
    """
    if x.shape[dim] != plan.total_len:
        raise ValueError(
            f"tensor has {x.shape[dim]} tokens along dim {dim}, but the plan has "
            f"{plan.total_len} (context {plan.context_len} + query {plan.query_len})"
        )
    pieces = [x.narrow(dim, start, end - start) for start, end in plan.global_ranges(rank)]
    return torch.cat(pieces, dim=dim)


def unshard(locals_: Sequence[torch.Tensor], plan: Plan, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard`: the prompt in global order from every rank's local tensor.

    The anchor and the query are taken from rank 0 (every rank holds the same ones).
    """
    if len(locals_) != plan.world_size:
        raise ValueError(f"expected {plan.world_size} local tensors, got {len(locals_)}")
    for rank, local in enumerate(locals_):
        if local.shape[dim] != plan.local_len(rank):
            raise ValueError(
                f"rank {rank}'s tensor has {local.shape[dim]} tokens along dim {dim}, "
                f"the plan gives it {plan.local_len(rank)}"
            )
    ranges = plan.local_ranges(0)
    anchor, query = ranges[0], ranges[-1]
    pieces = [locals_[0].narrow(dim, anchor[0], anchor[1] - anchor[0])]
    for block in range(plan.num_blocks):
        owner, slot = plan.block_slot(block)
        start, end = plan.local_ranges(owner)[1 + slot]
        pieces.append(locals_[owner].narrow(dim, start, end - start))
    pieces.append(locals_[0].narrow(dim, query[0], query[1] - query[0]))
    return torch.cat(pieces, dim=dim)
