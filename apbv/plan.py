"""Sequence plan for APB-V prefill: a pure function of (context length, query length, world size).

The prompt in global order is

    [ anchor (A) | virtual block 0 | virtual block 1 | ... | virtual block 2H-1 | query (Q) ]
      \\_______________________ context (N tokens) _______________________/

The N - A context tokens after the anchor are cut into 2H virtual blocks whose lengths differ by
at most one token (a block may be empty when N is tiny). Rank r owns blocks r and 2H-1-r
(ZigZag), so each rank holds the same amount of context and the same attention work. Its local
sequence, in global order, is

    [ anchor | block r | block 2H-1-r | query ]

Every rank holds the whole anchor and the whole query. P (``passing_len``) is the number of
tokens, per KV head and per layer, that each virtual block passes to the blocks after it.

Two other layouts serve the comparison modes, with the same attention semantics (a block sees
the anchor, the selections of all earlier blocks, and itself causally):

- ``contiguous``: H blocks, rank r holds block r (APB without ZigZag: the last rank does most);
- ``star``: Star Attention's split. The anchor is the first ceil(N/H) tokens (Star's first
  block); the rest is cut into H-1 blocks for ranks 1..H-1, and rank 0 holds an empty block.

Every rank holds the same number of blocks (2 for zigzag, 1 otherwise), so every rank takes
part in the same collectives.

Nothing here touches torch.distributed; every rank's share can be computed (and tested) in one
process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

from apbv.validate import check_int

Range = tuple[int, int]  # [start, end)
LAYOUTS = ("zigzag", "contiguous", "star")
QUERY_RANK = 0
"""The rank that caches the query's KV and the generated tokens', and picks each token."""


def default_anchor_len(context_len: int) -> int:
    """About N/64 tokens, the reference's choice (no rounding to kernel tiles)."""
    return min(context_len, math.ceil(context_len / 64))


def default_passing_len(context_len: int) -> int:
    """About N/128 tokens per virtual block, per KV head, per layer."""
    return math.ceil(context_len / 128)


def split_evenly(total: int, parts: int) -> list[int]:
    """Lengths of ``parts`` pieces of ``total`` that differ by at most one, longer ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def patch_ranges(num_patches: int, world_size: int) -> tuple[Range, ...]:
    """The frame split: rank r encodes temporal patches [start, end) of the T patches.

    Contiguous ranges in rank order whose sizes differ by at most one, earlier ranks longer.
    Pure: every rank's range is computed in one process. ValueError if T < H (a rank would get
    no patch).
    """
    check_int("world_size", world_size, 1)
    check_int("num_patches", num_patches, 0)
    if num_patches < world_size:
        raise ValueError(
            f"the sampled video has {num_patches} temporal patches (2 frames each) but "
            f"{world_size} ranks need at least one each: use at most {num_patches} ranks, or "
            f"sample more frames (a higher fps or a larger nframes)"
        )
    out, start = [], 0
    for size in split_evenly(num_patches, world_size):
        out.append((start, start + size))
        start += size
    return tuple(out)


@dataclass(frozen=True)
class Plan:
    """Where every prompt token lives. Build it with :func:`make_plan`."""

    context_len: int
    """N: tokens before the question (system prompt, video, text)."""
    query_len: int
    """Q: question, options, instruction and the assistant header."""
    world_size: int
    """H: number of ranks."""
    anchor_len: int
    """A: the first A context tokens, held and attended by every rank."""
    passing_len: int
    """P: tokens each virtual block passes on, per KV head, per layer."""
    blocks: tuple[Range, ...]
    """The virtual blocks as global [start, end) ranges, in prompt order (2H for zigzag)."""
    layout: str = "zigzag"
    """zigzag, contiguous or star (see the module docstring)."""

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def blocks_per_rank(self) -> int:
        return self.num_blocks // self.world_size

    @property
    def total_len(self) -> int:
        return self.context_len + self.query_len

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank!r}")

    def rank_blocks(self, rank: int) -> tuple[int, ...]:
        """The virtual blocks of ``rank`` in prompt order: (rank, 2H-1-rank) for zigzag."""
        self._check_rank(rank)
        if self.layout == "zigzag":
            return rank, self.num_blocks - 1 - rank
        return (rank,)

    def block_slot(self, block: int) -> tuple[int, int]:
        """(owner rank, index of the block among the owner's blocks)."""
        if self.layout == "zigzag" and block >= self.world_size:
            return self.num_blocks - 1 - block, 1
        return block, 0

    def block_owner(self, block: int) -> int:
        """The rank that holds virtual block ``block``."""
        return self.block_slot(block)[0]

    def block_len(self, block: int) -> int:
        start, end = self.blocks[block]
        return end - start

    @cached_property
    def max_block_len(self) -> int:
        return max(end - start for start, end in self.blocks)

    def selected_len(self, block: int) -> int:
        """How many tokens block ``block`` passes on: min(P, its length)."""
        return min(self.passing_len, self.block_len(block))

    @cached_property
    def passing_capacity(self) -> int:
        """Rows of the fixed-shape buffer each rank sends per block (same on every rank)."""
        return min(self.passing_len, self.max_block_len)

    @property
    def is_exact(self) -> bool:
        """True when every block passes all of its tokens: attention is then exactly causal."""
        return self.passing_len >= self.max_block_len

    def exact(self) -> Plan:
        """The same layout with P = infinity (every block passes everything)."""
        return replace(self, passing_len=max(self.passing_len, self.max_block_len))

    def global_ranges(self, rank: int) -> tuple[Range, ...]:
        """Global [start, end) of (anchor, each block of ``rank``, query)."""
        n = self.context_len
        blocks = tuple(self.blocks[b] for b in self.rank_blocks(rank))
        return ((0, self.anchor_len), *blocks, (n, n + self.query_len))

    def local_ranges(self, rank: int) -> tuple[Range, ...]:
        """The same segments in rank-local coordinates (they are consecutive)."""
        out = []
        offset = 0
        for start, end in self.global_ranges(rank):
            out.append((offset, offset + end - start))
            offset += end - start
        return tuple(out)

    def local_len(self, rank: int) -> int:
        return self.local_ranges(rank)[-1][1]

    def local_blocks_range(self, rank: int) -> Range:
        """Local [start, end) of all of ``rank``'s blocks together (between anchor and query)."""
        ranges = self.local_ranges(rank)
        return ranges[0][1], ranges[-1][0]

    def anchor_share(self, rank: int) -> Range:
        """The slice of the anchor whose keys ``rank`` contributes to the exact query attention.

        The anchor is on every rank, but each anchor key must be counted once when the H query
        partials are merged, so the anchor is split into H near-equal slices.
        """
        self._check_rank(rank)
        lengths = split_evenly(self.anchor_len, self.world_size)
        start = sum(lengths[:rank])
        return start, start + lengths[rank]

    def describe(self) -> str:
        """A human-readable table of the layout."""
        lines = [
            f"context N={self.context_len}  query Q={self.query_len}  ranks H={self.world_size}  "
            f"anchor A={self.anchor_len}  passing P={self.passing_len}  layout {self.layout}"
            + ("  (exact: P >= every block)" if self.is_exact else ""),
            f"{'rank':>4} {'blocks':>9} {'block tokens':>16} {'local tokens':>12} "
            f"{'passing in (tokens/KV head)':>28}",
        ]
        for rank in range(self.world_size):
            mine = self.rank_blocks(rank)
            passing = sum(self.selected_len(u) for b in mine for u in range(b))
            names = ",".join(map(str, mine))
            lengths = "+".join(str(self.block_len(b)) for b in mine)
            lines.append(
                f"{rank:>4} {names:>9} {lengths:>16} {self.local_len(rank):>12} {passing:>28}"
            )
        return "\n".join(lines)


def make_plan(
    context_len: int,
    query_len: int,
    world_size: int,
    *,
    anchor_len: int | None = None,
    passing_len: int | None = None,
    layout: str = "zigzag",
) -> Plan:
    """Plan the layout of an N-token context and a Q-token query over H ranks.

    Any N >= 1, Q >= 1, H >= 1 works: blocks differ by at most one token and may be empty.
    ZigZag: the extra tokens of an uneven split go to blocks 0..H-1 first, then 2H-1..H, so
    the ranks' context shares also differ by at most one token. ``layout`` "contiguous" and
    "star" serve the comparison modes (module docstring); star's default anchor is ceil(N/H).
    """
    check_int("context_len", context_len, 1)
    check_int("query_len", query_len, 1)
    check_int("world_size", world_size, 1)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; allowed: {', '.join(LAYOUTS)}")
    if anchor_len is None:
        if layout == "star":
            anchor_len = math.ceil(context_len / world_size)
        else:
            anchor_len = default_anchor_len(context_len)
    check_int("anchor_len", anchor_len, 0)
    if anchor_len > context_len:
        raise ValueError(f"anchor_len ({anchor_len}) must not exceed context_len ({context_len})")
    if passing_len is None:
        passing_len = default_passing_len(context_len)
    check_int("passing_len", passing_len, 0)

    rest = context_len - anchor_len
    if layout == "zigzag":
        num_blocks = 2 * world_size
        base, extra = divmod(rest, num_blocks)
        # Extras in ZigZag order of ownership: first blocks 0..H-1, then blocks 2H-1..H.
        order = list(range(world_size)) + list(range(num_blocks - 1, world_size - 1, -1))
        lengths = [base] * num_blocks
        for block in order[:extra]:
            lengths[block] += 1
    elif layout == "contiguous":
        lengths = split_evenly(rest, world_size)
    else:  # star: rank 0's block is the anchor itself
        lengths = [0] + (split_evenly(rest, world_size - 1) if world_size > 1 else [])
        lengths[0] += rest if world_size == 1 else 0
    blocks = []
    start = anchor_len
    for length in lengths:
        blocks.append((start, start + length))
        start += length
    assert start == context_len, (start, context_len)
    return Plan(
        context_len=context_len,
        query_len=query_len,
        world_size=world_size,
        anchor_len=anchor_len,
        passing_len=passing_len,
        blocks=tuple(blocks),
        layout=layout,
    )
