"""Which rank keeps which KV and which video rows travel where: pure arithmetic on a
:class:`~apbv.plan.Plan`, shared by the engine (:mod:`apbv.engine.kvcache`,
:mod:`apbv.engine.routing`) and the cost model (:mod:`apbv.cost`), which imports nothing from
``engine/``.

Every prompt token's KV is kept on exactly one rank: its anchor share, its blocks and, on the
query rank, the query. Video embeddings are encoded frame-parallel (rank r: a contiguous range
of the video tokens, [p0 * S, p1 * S) with S tokens per temporal patch; with per-token pruning
the kept tokens of its patches, :func:`token_routes`) and sent to the ranks whose ZigZag pieces
hold them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from apbv.plan import QUERY_RANK, Plan, Range


def owned_local_ranges(plan: Plan, rank: int) -> list[Range]:
    """Local [start, end) runs of the prompt tokens whose KV ``rank`` keeps, in global order:
    its anchor share, its blocks and, on the query rank, the query."""
    ranges = [plan.anchor_share(rank), plan.local_blocks_range(rank)]
    if rank == QUERY_RANK:
        ranges.append(plan.local_ranges(rank)[-1])
    return ranges


def owned_local_index(plan: Plan, rank: int) -> torch.Tensor:
    """Local indices (int64) of the prompt tokens whose KV ``rank`` keeps, in global order."""
    return torch.cat([torch.arange(a, b) for a, b in owned_local_ranges(plan, rank)])


@dataclass(frozen=True)
class VideoSpan:
    """Where the video's placeholder tokens sit in the global prompt: one or more runs, in
    order (Qwen2.5-VL: one run; InternVL3: one run per frame, text between). The k-th video
    embedding (in the tower's output order) replaces the k-th placeholder token."""

    runs: tuple[Range, ...]
    """Global [start, end) of each run of video tokens, increasing and disjoint."""
    tokens_per_patch: int
    """LLM tokens per temporal patch: (h / merge) * (w / merge)."""

    def __post_init__(self) -> None:
        assert self.runs and all(a < b for a, b in self.runs), self.runs
        assert all(self.runs[i][1] <= self.runs[i + 1][0] for i in range(len(self.runs) - 1)), \
            self.runs

    @classmethod
    def contiguous(cls, start: int, num_tokens: int, tokens_per_patch: int) -> VideoSpan:
        """One run of ``num_tokens`` video tokens from global position ``start``."""
        return cls(((start, start + num_tokens),), tokens_per_patch)

    @property
    def start(self) -> int:
        """Global position of the first video token."""
        return self.runs[0][0]

    @property
    def end(self) -> int:
        """Global position after the last video token."""
        return self.runs[-1][1]

    @property
    def num_tokens(self) -> int:
        return _count(list(self.runs))


def _intersect(a: Range, b: Range) -> Range | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def needed_video_tokens(plan: Plan, span: VideoSpan, rank: int) -> list[Range]:
    """Video-token index ranges (0-based within the video, counted over every run) whose
    embeddings ``rank`` needs, in the order its shard holds the tokens (global order)."""
    out: list[Range] = []
    for piece in plan.global_ranges(rank):
        before = 0  # video tokens in the runs before this one
        for run in span.runs:
            hit = _intersect(piece, run)
            if hit:
                out.append((hit[0] - run[0] + before, hit[1] - run[0] + before))
            before += run[1] - run[0]
    return out


def embedding_routes(
    plan: Plan, span: VideoSpan, patch_ranges: list[Range]
) -> list[list[list[Range]]]:
    """routes[src][dst]: the video-token ranges rank ``src`` encodes (its temporal patches
    ``patch_ranges[src]``, every token of each) and rank ``dst`` needs."""
    per_patch = span.tokens_per_patch
    return token_routes(plan, span, [(p0 * per_patch, p1 * per_patch)
                                     for p0, p1 in patch_ranges])


def token_routes(plan: Plan, span: VideoSpan, encoded: list[Range]) -> list[list[list[Range]]]:
    """routes[src][dst]: the video-token ranges rank ``src`` encodes (``encoded[src]``: its
    rows become the video tokens [a, b), counted over every run) and rank ``dst`` needs."""
    return [[[hit for need in needed_video_tokens(plan, span, dst)
              if (hit := _intersect(need, rows))]
             for dst in range(plan.world_size)]
            for rows in encoded]


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
