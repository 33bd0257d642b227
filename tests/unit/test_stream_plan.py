"""apbv.engine.stream_plan: a live stream's chunk bookkeeping for every rank in one process.

Each rank's cache is simulated as the list of rows it holds (the header on the query rank,
then its own chunks in order, evicted ones cut out); the pure functions must place every chunk
where its owner's cache holds it, keep the ranks balanced, evict exactly what the window says,
and count temporal patches from the timestamps.
"""

from __future__ import annotations

import pytest

from apbv.engine.stream_plan import (
    Chunk,
    StreamSpec,
    check_room,
    evictions,
    patch_indices,
    pick_owner,
    row_start,
)
from apbv.plan import QUERY_RANK

HEADER = 7


def _chunk(index: int, owner: int, tokens: int, end_s: float = 0.0) -> Chunk:
    return Chunk(index, owner, first_patch=index, patches=1, tokens=tokens, start_s=end_s,
                 end_s=end_s, first_position=0)


def _simulate(world: int, sizes: list[int], spec: StreamSpec) -> tuple[list[Chunk], list[list]]:
    """Append chunks of ``sizes`` tokens (1 s apart) on ``world`` ranks, evicting as the window
    says; returns the held chunks and each rank's cache rows (a chunk index per row; -1 for
    the header), checking every row start on the way."""
    tokens = [HEADER if r == QUERY_RANK else 0 for r in range(world)]
    caches: list[list] = [[-1] * HEADER if r == QUERY_RANK else [] for r in range(world)]
    chunks: list[Chunk] = []
    for i, n in enumerate(sizes):
        owner = pick_owner(tokens)
        assert tokens[owner] == min(tokens) and owner == tokens.index(min(tokens))
        chunk = _chunk(i, owner, n, end_s=float(i))
        chunks.append(chunk)
        caches[owner] += [i] * n
        tokens[owner] += n
        for c in chunks:  # every held chunk sits where its owner's cache holds it
            start = row_start(chunks, c, HEADER, QUERY_RANK)
            assert caches[c.owner][start:start + c.tokens] == [c.index] * c.tokens, (world, c)
        for _ in range(evictions(chunks, spec, world)):
            oldest = chunks[0]
            start = row_start(chunks, oldest, HEADER, QUERY_RANK)
            del caches[oldest.owner][start:start + oldest.tokens]
            tokens[oldest.owner] -= oldest.tokens
            chunks.pop(0)
        assert [len(c) for c in caches] == tokens
    return chunks, caches


@pytest.mark.parametrize("world_size", range(1, 6))
def test_owners_and_row_starts_on_every_rank(world_size: int) -> None:
    sizes = [4, 8, 4, 12, 4, 4, 16, 4, 8, 4, 4, 4]
    chunks, caches = _simulate(world_size, sizes, StreamSpec(height=28, width=28))
    assert len(chunks) == len(sizes)  # no window: nothing evicted
    held = [len(c) for c in caches]
    assert max(held) - min(held) <= max(max(sizes), HEADER), held  # within one chunk


@pytest.mark.parametrize("world_size", range(1, 6))
def test_evictions_keep_the_window_and_the_rows_in_place(world_size: int) -> None:
    sizes = [4, 8, 4, 12, 4, 4, 16, 4, 8, 4, 4, 4] * 2
    chunks, _ = _simulate(world_size, sizes, StreamSpec(height=28, width=28, window_s=5.0))
    assert [c.index for c in chunks] == list(range(len(sizes) - 5, len(sizes)))
    budget = 6  # video tokens per rank on average
    chunks, _ = _simulate(world_size, sizes,
                          StreamSpec(height=28, width=28, window_tokens=budget))
    video = sum(c.tokens for c in chunks)
    assert video <= budget * world_size or len(chunks) == 1, (video, len(chunks))
    dropped_one_more = video + (sizes[chunks[0].index - 1] if chunks[0].index else 0)
    assert chunks[0].index == 0 or dropped_one_more > budget * world_size


def test_evictions_keep_the_newest_chunk_and_count_in_order() -> None:
    spec = StreamSpec(height=28, width=28, window_tokens=1)
    chunks = [_chunk(i, 0, 10) for i in range(3)]
    assert evictions(chunks, spec, 1) == 2  # the newest stays, however large
    assert evictions(chunks[:1], spec, 1) == 0
    spec = StreamSpec(height=28, width=28, window_s=2.0)
    chunks = [_chunk(i, 0, 1, end_s=s) for i, s in enumerate([0.0, 1.0, 1.5, 3.0])]
    assert evictions(chunks, spec, 1) == 2  # 3 - 0 >= 2 and 3 - 1 >= 2, not 3 - 1.5
    assert evictions(chunks, StreamSpec(height=28, width=28), 1) == 0


def test_patch_indices_round_and_always_move_on() -> None:
    assert patch_indices([0.0, 1.0, 2.0], 0.0, 1.0, 0) == [0, 1, 2]
    assert patch_indices([10.0, 13.2], 10.0, 1.0, 0) == [0, 3]  # a gap skips patches
    assert patch_indices([4.1, 4.2, 4.3], 0.0, 1.0, 4) == [4, 5, 6]  # never twice the same
    assert patch_indices([1.0], 0.0, 1.0, 5) == [5]  # after the previous append's last


def test_check_room_names_the_context_and_the_window() -> None:
    check_room(90, 10, 100)
    with pytest.raises(ValueError, match=r"holds 91 tokens and a chunk of 10 would pass the "
                                         r"model's context of 100: open the stream with a "
                                         r"window \(window_s or window_tokens\)"):
        check_room(91, 10, 100)
