"""One request through the model on this rank: vision, embeddings, positions, prefill, decode.

``run_prompt`` starts from what preprocessing produced (token ids of the whole prompt, the
video's patch grid, and this rank's pixel rows only) and returns the generated tokens with
per-stage timings. It is the same on every rank; ranks differ only in the data they hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from apbv.engine.decode import greedy_continue, pick_token
from apbv.layout import shard
from apbv.model.qwen2_5_vl import QwenVL
from apbv.modes import get_mode
from apbv.plan import Plan, Range
from apbv.positions import mrope_positions, video_token_runs
from apbv.engine.prefill import prefill
from apbv.timing import StageTimer
from apbv.engine.routing import (
    VideoSpan,
    embedding_routes,
    needed_video_tokens,
    route_embeddings,
    transfer_bytes,
)


@dataclass(frozen=True)
class PromptInputs:
    """A preprocessed request as one rank holds it."""

    context_ids: torch.Tensor
    """(N,) int64: everything before the question, video placeholders expanded."""
    query_ids: torch.Tensor
    """(Q,) int64: the question and the assistant header."""
    video_grid: tuple[int, int, int]
    """(t, h, w) patch grid of the whole video (as the processor's video_grid_thw)."""
    second_per_grid_t: float
    """Seconds per temporal patch (temporal_patch_size / sampled fps)."""
    patch_ranges: tuple[Range, ...]
    """Per rank, the temporal patches [p0, p1) it encodes ((0, t) everywhere when the mode does
    not split the vision work)."""
    pixel_values: torch.Tensor
    """The rows of this rank's patches only: ((p1 - p0) * h * w, C * 2 * 14 * 14)."""


@dataclass
class PromptResult:
    token_ids: list[int]
    plan: Plan
    seconds: dict[str, float] = field(default_factory=dict)
    """Per stage, max over ranks."""
    embedding_bytes: int = 0
    allgather_bytes: int = 0
    kv_cache_bytes: int = 0
    first_logits: torch.Tensor | None = None


def run_prompt(
    qwen: QwenVL,
    inputs: PromptInputs,
    timer: StageTimer,
    *,
    rank: int,
    world_size: int,
    mode: str = "spava",
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    anchor_len: int | None = None,
    passing_len: int | None = None,
    max_new_tokens: int = 1,
) -> PromptResult:
    """Frame-parallel vision, ZigZag prefill with APB-V attention, first token, exact decode.

    ``mode`` is one of :data:`apbv.modes.MODE_NAMES`; it picks the plan, the attention op's
    mode and whether the vision work is split.
    """
    spec = get_mode(mode)
    ids = torch.cat([inputs.context_ids, inputs.query_ids])
    plan = spec.plan(len(inputs.context_ids), len(inputs.query_ids), world_size,
                     anchor_len=anchor_len, passing_len=passing_len)
    runs = video_token_runs(ids, qwen.video_token_id)
    if len(runs) != 1 or runs[0][1] > plan.context_len:
        raise ValueError(f"expected one video inside the context, found video tokens at {runs}")
    t, h, w = inputs.video_grid
    merge = qwen.spatial_merge_size
    span = VideoSpan(runs[0][0], runs[0][1] - runs[0][0], (h // merge) * (w // merge))
    patch_range = inputs.patch_ranges[rank]

    with torch.inference_mode():
        with timer.stage("vision"):
            grid = torch.tensor([[patch_range[1] - patch_range[0], h, w]])
            local_video = qwen.vision_tower(inputs.pixel_values, grid)
        with timer.stage("transfer"):
            routes = embedding_routes(plan, span, list(inputs.patch_ranges))
            if spec.vit_split:
                video_rows = route_embeddings(local_video, routes, patch_range,
                                              span.tokens_per_patch, rank, group)
            else:  # every rank encoded the whole video: take its own rows, move nothing
                video_rows = torch.cat([local_video[s:e] for s, e in
                                        needed_video_tokens(plan, span, rank)])
        with timer.stage("prefill"):
            local_ids = shard(ids.unsqueeze(0), plan, rank)
            embeds = qwen.embed(local_ids)
            is_video = (local_ids == qwen.video_token_id).to(embeds.device)
            assert int(is_video.sum()) == video_rows.shape[0], (int(is_video.sum()), video_rows.shape)
            embeds[is_video] = video_rows.to(embeds.dtype)
            positions = mrope_positions(ids, [inputs.video_grid], [inputs.second_per_grid_t],
                                        video_token_id=qwen.video_token_id,
                                        spatial_merge_size=merge,
                                        tokens_per_second=qwen.tokens_per_second)
            local_positions = shard(positions, plan, rank, dim=2)
            logits, cache = prefill(qwen, embeds, local_positions, plan, rank=rank,
                                    mode=spec.op_mode,
                                    group=group, backend=backend, reserve=max_new_tokens)
        with timer.stage("first_token"):
            first = pick_token(logits, group)
    with timer.stage("decode"):
        tokens = greedy_continue(qwen, first, int(positions.max()) + 1, cache, rank=rank,
                                 max_new_tokens=max_new_tokens, group=group, backend=backend)
    row_bytes = local_video.shape[-1] * local_video.element_size()
    moved, allgather = transfer_bytes(routes, span.num_tokens, row_bytes)
    if not spec.vit_split:
        moved = 0
    return PromptResult(
        token_ids=tokens,
        plan=plan,
        embedding_bytes=moved,
        allgather_bytes=allgather,
        kv_cache_bytes=cache.nbytes(),
        first_logits=logits,
    )
