"""Dealing an evaluation's samples to G rank groups so that the groups finish together.

With ``--groups G`` the world of H*G ranks runs as G sequence-parallel groups of H ranks
(:func:`apbv.distributed.rank_groups`); each group answers its own samples, and after every
round (one sample per group) the groups' rows meet on rank 0, which writes them. A round lasts
as long as its slowest sample, so :func:`deal` sorts the samples by cost, longest first, and
gives each round G samples of similar cost; within a round the costliest goes to the group
with the least work so far. The cost of a sample is the cost model's predicted seconds
(:func:`apbv.eval.forecast.predicted_seconds`: the video's headers, no decoding), or where the
cost model cannot read the checkpoint its video file's size (:func:`sample_cost`: a stat).
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def sample_cost(path: str | os.PathLike[str]) -> float:
    """A sample's predicted cost: its video file's size in bytes (0 for a missing file, whose
    sample fails at once)."""
    try:
        return float(os.path.getsize(path))
    except OSError:
        return 0.0


def deal(costs: Sequence[float], groups: int) -> list[list[int]]:
    """The indices of ``costs`` each of ``groups`` groups runs, in the order it runs them:
    longest first, G of similar cost per round, the costliest of a round to the group with
    the least total so far (ties: the lower group). Every index appears once; the groups'
    list lengths differ by at most one. One group runs them in their own order."""
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    if groups == 1:
        return [list(range(len(costs)))]
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    dealt: list[list[int]] = [[] for _ in range(groups)]
    load = [0.0] * groups
    for start in range(0, len(order), groups):
        batch = order[start:start + groups]
        idle = sorted(range(groups), key=lambda g: (load[g], g))
        for i, g in zip(batch, idle):
            dealt[g].append(i)
            load[g] += costs[i]
    return dealt
