"""Routing of video embeddings when the prompt holds several runs of video tokens (InternVL3:
one run per frame, text between), for every rank of 1..5 in one process.

The oracle is the prompt itself: the k-th video token of the global prompt takes the k-th
embedding, so the embeddings a rank's shard needs are the video indices of the video tokens
in :func:`apbv.layout.shard` of the prompt, in local order. The routes must deliver exactly
those rows, from the rank that encoded them (whole temporal units per rank).
"""

from __future__ import annotations

import pytest
import torch

from apbv.layout import shard
from apbv.ownership import VideoSpan, embedding_routes, needed_video_tokens
from apbv.plan import make_plan, patch_ranges
from apbv.positions import video_token_runs

VIDEO = 7  # the placeholder id in the synthetic prompts below


def _prompt(units: int, per_unit: int, between: int, head: int, tail: int) -> torch.Tensor:
    """Context ids: ``head`` text, then ``units`` runs of ``per_unit`` video tokens with
    ``between`` text tokens between runs, then ``tail`` text."""
    ids = [1] * head
    for u in range(units):
        ids += [VIDEO] * per_unit + ([2] * between if u < units - 1 else [])
    return torch.tensor(ids + [3] * tail)


def _rows_received(routes: list, dst: int, patches: list, per_unit: int) -> list[int]:
    """Video indices rank ``dst`` receives, in the order the all-to-all delivers them."""
    out = []
    for src in range(len(routes)):
        base = patches[src][0] * per_unit
        for s, e in routes[src][dst]:
            assert base <= s and e <= patches[src][1] * per_unit, (src, dst, s, e)
            out += list(range(s, e))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("mode", ["exact", "spava"])
@pytest.mark.parametrize("shape", [(5, 16, 7, 8, 2), (9, 4, 3, 1, 5), (6, 30, 1, 40, 1)])
def test_runs_route_to_their_owners(world_size: int, mode: str, shape: tuple) -> None:
    from apbv.modes import get_mode

    units, per_unit, between, head, tail = shape
    context = _prompt(units, per_unit, between, head, tail)
    query_len = 6
    ids = torch.cat([context, torch.full((query_len,), 4)])
    plan = get_mode(mode).plan(len(context), query_len, world_size)
    span = VideoSpan(tuple(video_token_runs(ids, VIDEO)), per_unit)
    assert len(span.runs) == units and span.num_tokens == units * per_unit
    index = torch.cumsum(ids == VIDEO, 0) - 1  # the k of the k-th video token
    patches = patch_ranges(units, world_size)
    routes = embedding_routes(plan, span, patches)
    for rank in range(world_size):
        local = shard(ids.unsqueeze(0), plan, rank)[0]
        local_index = shard(index.unsqueeze(0), plan, rank)[0]
        want = local_index[local == VIDEO].tolist()
        needed = [k for s, e in needed_video_tokens(plan, span, rank) for k in range(s, e)]
        assert needed == want, (rank, needed[:20], want[:20])
        got = _rows_received(routes, rank, patches, per_unit)
        assert sorted(got) == got and got == want, (rank, got[:20], want[:20])


def test_one_run_is_the_contiguous_span() -> None:
    """Qwen2.5-VL's one run: the pieces of each rank's shard cut at the video's bounds."""
    ids = _prompt(1, 40, 0, 5, 9)
    plan = make_plan(len(ids), 3, 3, anchor_len=4, passing_len=2)
    one = VideoSpan(tuple(video_token_runs(torch.cat([ids, torch.zeros(3)]).long(), VIDEO)), 8)
    assert one == VideoSpan.contiguous(5, 40, 8)
    assert (one.start, one.end, one.num_tokens) == (5, 45, 40)
    for rank in range(3):
        cut = [(max(a, 5) - 5, min(b, 45) - 5) for a, b in plan.global_ranges(rank)
               if max(a, 5) < min(b, 45)]
        assert needed_video_tokens(plan, one, rank) == cut
