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

Nothing here touches torch.distributed; every rank's share can be computed (and tested) in one
process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

Range = tuple[int, int]  # [start, end)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


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
    """The 2H virtual blocks as global [start, end) ranges, in prompt order."""

    @property
    def num_blocks(self) -> int:
        return 2 * self.world_size

    @property
    def total_len(self) -> int:
        return self.context_len + self.query_len

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank!r}")

    def rank_blocks(self, rank: int) -> tuple[int, int]:
        """The two virtual blocks of ``rank``: (rank, 2H-1-rank)."""
        self._check_rank(rank)
        return rank, self.num_blocks - 1 - rank

    def block_owner(self, block: int) -> int:
        """The rank that holds virtual block ``block``."""
        return block if block < self.world_size else self.num_blocks - 1 - block

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

    def global_ranges(self, rank: int) -> tuple[Range, Range, Range, Range]:
        """Global [start, end) of (anchor, block rank, block 2H-1-rank, query) on ``rank``."""
        first, second = self.rank_blocks(rank)
        n = self.context_len
        return (0, self.anchor_len), self.blocks[first], self.blocks[second], (n, n + self.query_len)

    def local_ranges(self, rank: int) -> tuple[Range, Range, Range, Range]:
        """The same four segments in rank-local coordinates (they are consecutive)."""
        out = []
        offset = 0
        for start, end in self.global_ranges(rank):
            out.append((offset, offset + end - start))
            offset += end - start
        return tuple(out)  # type: ignore[return-value]

    def local_len(self, rank: int) -> int:
        return self.local_ranges(rank)[-1][1]

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
            f"anchor A={self.anchor_len}  passing P={self.passing_len}"
            + ("  (exact: P >= every block)" if self.is_exact else ""),
            f"{'rank':>4} {'blocks':>9} {'block tokens':>16} {'local tokens':>12} "
            f"{'passing in (tokens/KV head)':>28}",
        ]
        for rank in range(self.world_size):
            first, second = self.rank_blocks(rank)
            passing = sum(self.selected_len(u) for u in range(first)) + sum(
                self.selected_len(u) for u in range(second)
            )
            lengths = f"{self.block_len(first)}+{self.block_len(second)}"
            lines.append(
                f"{rank:>4} {f'{first},{second}':>9} {lengths:>16} {self.local_len(rank):>12} "
                f"{passing:>28}"
            )
        return "\n".join(lines)


def make_plan(
    context_len: int,
    query_len: int,
    world_size: int,
    *,
    anchor_len: int | None = None,
    passing_len: int | None = None,
) -> Plan:
    """Plan the ZigZag layout of an N-token context and a Q-token query over H ranks.

    Any N >= 1, Q >= 1, H >= 1 works: blocks differ by at most one token and may be empty.
    The extra tokens of an uneven split go to blocks 0..H-1 first, then 2H-1..H, so the ranks'
    context shares also differ by at most one token.
    """
    _check_int("context_len", context_len, 1)
    _check_int("query_len", query_len, 1)
    _check_int("world_size", world_size, 1)
    if anchor_len is None:
        anchor_len = default_anchor_len(context_len)
    _check_int("anchor_len", anchor_len, 0)
    if anchor_len > context_len:
        raise ValueError(f"anchor_len ({anchor_len}) must not exceed context_len ({context_len})")
    if passing_len is None:
        passing_len = default_passing_len(context_len)
    _check_int("passing_len", passing_len, 0)

    num_blocks = 2 * world_size
    rest = context_len - anchor_len
    base, extra = divmod(rest, num_blocks)
    # Extras in ZigZag order of ownership: first blocks 0..H-1, then blocks 2H-1..H.
    order = list(range(world_size)) + list(range(num_blocks - 1, world_size - 1, -1))
    lengths = [base] * num_blocks
    for block in order[:extra]:
        lengths[block] += 1
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
    )
