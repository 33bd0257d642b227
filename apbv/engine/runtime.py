"""One preprocessed request through the model on this rank: vision, embeddings, positions,
prefill, first token, decode.

``run_prompt`` starts from what preprocessing produced (token ids of the whole prompt, the
video's patch grid, and this rank's pixel rows only) and returns the :class:`Result` with
per-stage timings. It is the same on every rank; ranks differ only in the data they hold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from apbv import comm
from apbv.distributed import DistInfo
from apbv.engine.decode import (
    choice_table,
    decode_reserve,
    greedy_continue,
    host_token,
    pick_token,
    score_choices,
)
from apbv.engine.kvcache import RankKVCache
from apbv.engine.prefill import prefill
from apbv.engine.request import PromptInputs, Request, RequestCancelled, Result, cut_at_stop
from apbv.engine.routing import (
    VideoSpan,
    embedding_routes,
    needed_video_tokens,
    route_embeddings,
    transfer_bytes,
)
from apbv.layout import shard
from apbv.model.adapter import VideoModel
from apbv.plan import QUERY_RANK
from apbv.timing import TTFT_STAGES, StageTimer


class RequestFailed(RuntimeError):
    """Another rank's non-ValueError failure, raised on the ranks where nothing went wrong."""


def raise_if_any_failed(error: Exception | None, group: dist.ProcessGroup | None) -> None:
    """Agree on failure (a collective): re-raise this rank's ``error``, or on the other ranks
    an error naming the rank that failed and its message (ValueError when it was one; a
    :class:`RequestCancelled` as it is)."""
    failure = comm.first_failure(error, group)
    if failure is None:
        return
    if error is not None:
        raise error
    rank, kind, message = failure
    if kind == RequestCancelled.__name__:
        raise RequestCancelled(message)
    text = f"the request failed on rank {rank}: {kind}: {message}"
    raise ValueError(text) if kind == "ValueError" else RequestFailed(text)


def cancelled_here(stop: Callable[[], bool] | None, info: DistInfo,
                   where: str) -> RequestCancelled | None:
    """The query rank's cancel at an agreement point (``where``: what it spares), for
    :func:`raise_if_any_failed`; None elsewhere, or while ``stop`` is false."""
    if stop is not None and info.rank == QUERY_RANK and stop():
        return RequestCancelled(f"cancelled before {where}")
    return None


def run_prompt(
    qwen: VideoModel, inputs: PromptInputs, request: Request, info: DistInfo, timer: StageTimer,
    on_token: Callable[[int], None] | None = None, stop: Callable[[], bool] | None = None,
    *, graphs: bool = False,
) -> Result:
    """Frame-parallel vision, ZigZag prefill with APB-V attention, first token, exact decode.

    ``request.mode`` picks the plan, the attention overlap and whether the vision work is
    split; the result is the same on every rank. ``on_token`` (every rank) gets each token id
    as soon as it is known, the first one included; ``stop`` (asked on the query rank between
    decode steps) ends the decode early (:attr:`Result.finish_reason` ``cancelled``);
    ``graphs``: decode replays a captured step (:func:`finish_answer`).
    """
    rank, group, mode = info.rank, info.group, request.mode
    ids = torch.cat([inputs.context_ids, inputs.query_ids])
    choice_ids = inputs.choice_ids
    plan = request.plan(len(inputs.context_ids), len(inputs.query_ids), info.world_size)
    start, length = qwen.video_span(ids)
    if start + length > plan.context_len:
        raise ValueError(f"the video tokens [{start}, {start + length}) must lie inside the "
                         f"context of {plan.context_len} tokens")
    t, h, w = inputs.video_grid
    merge = qwen.spatial_merge_size
    span = VideoSpan(start, length, (h // merge) * (w // merge))
    patch_range = inputs.patch_ranges[rank]

    with torch.inference_mode():
        with timer.stage("vision"):
            error, local_video = None, inputs.vision_embeds  # set: a vision cache hit
            try:
                if local_video is None:
                    if inputs.frame_chunks is not None:  # vision.pipeline: decoded here
                        local_video = qwen.encode_frames(inputs.frame_chunks)
                    else:
                        grid = (patch_range[1] - patch_range[0], h, w)
                        local_video = qwen.vision_tower(inputs.pixel_values, grid)
                    assert len(local_video) == (patch_range[1] - patch_range[0]) \
                        * span.tokens_per_patch, (local_video.shape, patch_range)
                    if inputs.vision_store is not None:
                        inputs.vision_store(local_video)
            except Exception as exc:  # e.g. out of memory on this rank only
                error = exc
            error = error or cancelled_here(stop, info, "the prefill")
            raise_if_any_failed(error, group)  # reached on every rank, hit or miss
            cache_hit = not comm.any_rank(inputs.vision_embeds is None, group)
        with timer.stage("transfer"):
            routes = embedding_routes(plan, span, list(inputs.patch_ranges))
            if mode.vit_split:
                video_rows = route_embeddings(local_video, routes, patch_range,
                                              span.tokens_per_patch, rank, group)
            else:  # every rank encoded the whole video: take its own rows, move nothing
                video_rows = torch.cat([local_video[s:e] for s, e in
                                        needed_video_tokens(plan, span, rank)])
        with timer.stage("prefill"):
            local_ids = shard(ids.unsqueeze(0), plan, rank)
            embeds = qwen.embed(local_ids)
            is_video = (local_ids == qwen.video_token_id).to(embeds.device)
            assert int(is_video.sum()) == video_rows.shape[0], (int(is_video.sum()),
                                                                 video_rows.shape)
            embeds[is_video] = video_rows.to(embeds.dtype)
            positions = qwen.positions(ids, inputs.video_grid, inputs.second_per_grid_t)
            local_positions = shard(positions, plan, rank, dim=2)
            logits, cache = prefill(qwen, embeds, local_positions, plan, info,
                                    overlap=mode.overlap, kernel=request.kernel,
                                    reserve=decode_reserve(request.max_new_tokens, choice_ids)[0])
    tokens, choices, finish = finish_answer(
        qwen, logits, int(positions.max()) + 1, cache, info, timer, choices=request.choices,
        choice_ids=choice_ids, max_new_tokens=request.max_new_tokens, kernel=request.kernel,
        on_token=on_token, stop=stop, stop_texts=request.stop_texts, graphs=graphs)
    row_bytes = local_video.shape[-1] * local_video.element_size()
    moved, allgather = transfer_bytes(routes, span.num_tokens, row_bytes)
    seconds = timer.max_over_ranks(group)
    return Result(
        answer=answer_text(qwen, tokens, choices, request.stop_texts),
        token_ids=tokens,
        ttft_s=sum(seconds.get(s, 0.0) for s in TTFT_STAGES),
        seconds=seconds,
        mode=mode.name,
        world_size=info.world_size,
        frames=inputs.num_frames,
        context_len=plan.context_len,
        query_len=plan.query_len,
        anchor_len=plan.anchor_len,
        passing_len=plan.passing_len,
        embedding_bytes=moved if mode.vit_split else 0,
        allgather_bytes=allgather,
        kv_cache_bytes_max=int(comm.all_reduce_max(float(cache.nbytes()), group)),
        vision_cache_hit=cache_hit,
        first_logits=logits,
        choices=choices,
        finish_reason=finish,
    )


def finish_answer(
    qwen: VideoModel, logits: torch.Tensor, next_position: int, cache: RankKVCache,
    info: DistInfo, timer: StageTimer, *, choices: tuple[str, ...] | None,
    choice_ids: list[list[int]] | None, max_new_tokens: int, kernel: str | None,
    on_token: Callable[[int], None] | None = None, stop: Callable[[], bool] | None = None,
    stop_texts: Sequence[str] = (), graphs: bool = False,
) -> tuple[list[int], list[dict] | None, str]:
    """From the prompt's last ``logits`` (every rank) to the answer's tokens, with ``choices``
    the per-choice table of :class:`Result`, and why the answer ended (its
    ``finish_reason``): the first token (stage ``first_token``), then greedy decode (until
    EOS, a stop text, the length or ``stop``: :func:`greedy_continue`) or the choices' exact
    scores (stage ``decode``) over the distributed ``cache``; ``next_position`` is the first
    position after the prompt. ``graphs``: greedy decode replays a captured step
    (``decode.graphs``, resolved by the engine: :mod:`apbv.engine.decode_graph`).

    Single-token choices are scored by the first token's logits alone: no decode stage, the
    answer is ready with the first token. After scoring, the cache is back to the prompt.
    """
    with timer.stage("first_token"):
        first_token = pick_token(logits, info.group)  # stays on the device for decode
        first = host_token(first_token)
    if choices is not None:  # closed vocabulary: score every choice, generate nothing
        assert choice_ids is not None
        single = all(len(c) == 1 for c in choice_ids)
        with timer.stage("first_token" if single else "decode"):
            logprobs = score_choices(qwen, logits, choice_ids, next_position, cache, info,
                                     kernel=kernel)
        best = choice_ids[max(range(len(choice_ids)), key=lambda i: logprobs[i])]
        for token in best if on_token is not None else ():  # the chosen answer's tokens
            on_token(token)
        return best, choice_table(choices, choice_ids, logprobs), "stop"
    if on_token is not None:
        on_token(first)
    with timer.stage("decode"):
        tokens, finish = greedy_continue(qwen, first_token, first, next_position, cache, info,
                                         max_new_tokens=max_new_tokens, kernel=kernel,
                                         on_token=on_token, stop=stop, stop_texts=stop_texts,
                                         graphs=graphs)
    return tokens, None, finish


def answer_text(qwen: VideoModel, tokens: list[int], choices: list[dict] | None,
                stop_texts: Sequence[str] = ()) -> str:
    """The answer: the likeliest choice, or the tokens' text (special tokens left out) cut
    before the first stop text it holds."""
    if choices is not None:
        return max(choices, key=lambda c: c["logprob"])["text"]
    return cut_at_stop(qwen.processor.tokenizer.decode(tokens, skip_special_tokens=True),
                       stop_texts)[0]
