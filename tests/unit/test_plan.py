"""apbv.plan: properties for every H in 1..8 and awkward lengths, defaults and errors."""

from __future__ import annotations

import pytest

from apbv.plan import make_plan

LENGTHS = [1, 2, 3, 7, 15, 16, 17, 63, 64, 65, 127, 129, 1000, 4097, 32768, 100_003]


@pytest.mark.parametrize("world_size", range(1, 9))
@pytest.mark.parametrize("context_len", LENGTHS)
def test_blocks_cover_context_evenly(world_size: int, context_len: int) -> None:
    plan = make_plan(context_len, 5, world_size)
    assert len(plan.blocks) == 2 * world_size
    # Contiguous, in order, covering exactly [A, N).
    assert plan.blocks[0][0] == plan.anchor_len
    assert plan.blocks[-1][1] == context_len
    for (_, end), (start, _) in zip(plan.blocks, plan.blocks[1:]):
        assert end == start
    lengths = [e - s for s, e in plan.blocks]
    assert min(lengths) >= 0 and max(lengths) - min(lengths) <= 1, lengths
    # Every rank holds two blocks; ranks' context shares differ by at most one token.
    shares = [sum(plan.block_len(b) for b in plan.rank_blocks(r)) for r in range(world_size)]
    assert max(shares) - min(shares) <= 1, shares
    assert sum(shares) == context_len - plan.anchor_len


@pytest.mark.parametrize("world_size", range(1, 9))
def test_rank_blocks_zigzag_and_owner(world_size: int) -> None:
    plan = make_plan(1000, 3, world_size)
    owned = []
    for rank in range(world_size):
        first, second = plan.rank_blocks(rank)
        assert (first, second) == (rank, 2 * world_size - 1 - rank)
        assert plan.block_owner(first) == plan.block_owner(second) == rank
        owned += [first, second]
    assert sorted(owned) == list(range(2 * world_size))


@pytest.mark.parametrize("world_size", range(1, 9))
@pytest.mark.parametrize("context_len", [1, 5, 64, 999])
def test_local_ranges_and_anchor_shares(world_size: int, context_len: int) -> None:
    plan = make_plan(context_len, 4, world_size)
    shares = []
    for rank in range(world_size):
        glob = plan.global_ranges(rank)
        loc = plan.local_ranges(rank)
        assert [e - s for s, e in glob] == [e - s for s, e in loc]
        assert loc[0][0] == 0 and all(a[1] == b[0] for a, b in zip(loc, loc[1:]))
        assert plan.local_len(rank) == loc[-1][1]
        assert glob[0] == (0, plan.anchor_len) and glob[3] == (context_len, context_len + 4)
        shares.append(plan.anchor_share(rank))
    # The anchor shares partition [0, A) in rank order, differing by at most one token.
    assert shares[0][0] == 0 and shares[-1][1] == plan.anchor_len
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
    sizes = [e - s for s, e in shares]
    assert max(sizes) - min(sizes) <= 1


def test_defaults_follow_reference_fractions() -> None:
    plan = make_plan(32768, 64, 8)
    assert (plan.anchor_len, plan.passing_len) == (512, 256)  # N/64, N/128
    odd = make_plan(1000, 1, 2)
    assert (odd.anchor_len, odd.passing_len) == (16, 8)  # rounded up, never to kernel tiles
    tiny = make_plan(1, 1, 8)
    assert tiny.anchor_len == 1 and tiny.max_block_len == 0 and tiny.passing_capacity == 0


def test_explicit_sizes_and_passing() -> None:
    plan = make_plan(1000, 10, 4, anchor_len=0, passing_len=50)
    assert plan.anchor_len == 0 and plan.blocks[0] == (0, 125)
    assert plan.selected_len(0) == 50 and plan.passing_capacity == 50
    assert not plan.is_exact
    # ZigZag balance: every rank receives (2H-1) * P passing tokens when blocks are >= P.
    for rank in range(4):
        first, second = plan.rank_blocks(rank)
        received = sum(plan.selected_len(u) for u in range(first))
        received += sum(plan.selected_len(u) for u in range(second))
        assert received == 7 * 50
    exact = plan.exact()
    assert exact.is_exact and exact.passing_len == 125 and exact.blocks == plan.blocks
    big = make_plan(1000, 10, 4, anchor_len=0, passing_len=10**9)
    assert big.is_exact and big.passing_capacity == 125


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(context_len=0, query_len=1, world_size=1), "context_len must be >= 1, got 0"),
        (dict(context_len=10, query_len=0, world_size=1), "query_len must be >= 1, got 0"),
        (dict(context_len=10, query_len=1, world_size=0), "world_size must be >= 1, got 0"),
        (dict(context_len=10.0, query_len=1, world_size=1), "context_len must be an integer"),
        (dict(context_len=10, query_len=True, world_size=1), "query_len must be an integer"),
        (dict(context_len=10, query_len=1, world_size=1, anchor_len=11),
         "anchor_len (11) must not exceed context_len (10)"),
        (dict(context_len=10, query_len=1, world_size=1, anchor_len=-1),
         "anchor_len must be >= 0, got -1"),
        (dict(context_len=10, query_len=1, world_size=1, passing_len=-2),
         "passing_len must be >= 0, got -2"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        make_plan(**kwargs)
    assert message in str(info.value)


def test_bad_rank() -> None:
    plan = make_plan(100, 1, 2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        plan.rank_blocks(2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got -1"):
        plan.anchor_share(-1)


def test_describe_lists_every_rank() -> None:
    text = make_plan(1000, 10, 3).describe()
    assert "N=1000" in text and "H=3" in text
    assert len(text.splitlines()) == 2 + 3
