"""One preprocessed request through the model on this rank: vision, embeddings, positions,
prefill, first token, decode; and the rules every answer shares.

``run_prompt`` starts from what preprocessing produced (token ids of the whole prompt, the
video's patch grid, and this rank's pixel rows only) and returns the :class:`Result` with
per-stage timings. It is the same on every rank; ranks differ only in the data they hold.
A question over a live stream's held KV ends the same way (:mod:`apbv.engine.stream_ask`):
:func:`check_context` is the one context-fit rule, :func:`finish_answer` the first token and
decode, :func:`build_result` the one :class:`Result` builder.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from apbv import comm
from apbv.distributed import DistInfo
from apbv.engine.agree import agreement, cancelled_here
from apbv.engine.answer import Answer, DecodeSettings, PromptStats, keeps_records
from apbv.engine.choice_tree import kv_reserve, score_choices
from apbv.engine.decode import (
    choice_table,
    decode_reserve,
    greedy_continue,
    host_token,
    pick_token,
)
from apbv.engine.grammar import Guide
from apbv.engine.kvcache import RankKVCache
from apbv.engine.prefill import prefill
from apbv.engine.request import PromptInputs, Request, Result, cut_at_stop
from apbv.engine.routing import route_embeddings
from apbv.engine.sampling import Sampling, reported
from apbv.layout import shard
from apbv.model.adapter import VideoFeatures, VideoModel
from apbv.ownership import VideoSpan, needed_video_tokens, token_routes, transfer_bytes
from apbv.plan import Range
from apbv.timing import TTFT_STAGES, StageTimer

if TYPE_CHECKING:
    from apbv.engine.decode_graph import GraphSteps


def check_context(request: Request, context_len: int, query_len: int,
                  choice_ids: list[list[int]] | None, limit: int) -> None:
    """ValueError unless the prompt (``context_len`` + ``query_len`` tokens, or positions)
    plus ``request.max_new_tokens`` (with choices, ``choice_ids``: the longest choice's
    tokens) fits the model's context of ``limit`` positions (both named in the message)."""
    reserve, what = decode_reserve(request.max_new_tokens, choice_ids)
    total = context_len + query_len + reserve
    if total > limit:
        raise ValueError(
            f"the prompt ({context_len + query_len} tokens) plus {what} "
            f"({reserve}) is {total} tokens, beyond the model's context of "
            f"{limit}: sample fewer frames or pixels, or lower {what}")


def run_prompt(
    model: VideoModel, inputs: PromptInputs, request: Request, info: DistInfo, timer: StageTimer,
    on_token: Callable[[int], None] | None = None, stop: Callable[[], bool] | None = None,
    *, graphs: GraphSteps | None = None,
) -> Result:
    """Frame-parallel vision, ZigZag prefill with APB-V attention, first token, exact decode.

    ``request.mode`` picks the plan, the attention overlap and whether the vision work is
    split; the result is the same on every rank. ``on_token`` (every rank) gets each token id
    as soon as it is known, the first one included; ``stop`` (asked on the query rank between
    decode steps) ends the decode early (:attr:`Result.finish_reason` ``cancelled``);
    ``graphs``: decode replays a captured step, kept across requests (:func:`finish_answer`).
    """
    rank, group, mode = info.rank, info.group, request.mode
    ids = torch.cat([inputs.context_ids, inputs.query_ids])
    choice_ids = inputs.choice_ids
    plan = request.plan(len(inputs.context_ids), len(inputs.query_ids), info.world_size)
    t, h, w = inputs.video_grid
    merge = model.spatial_merge_size
    span = VideoSpan(tuple(model.video_runs(ids)), (h // merge) * (w // merge))
    if span.end > plan.context_len:
        raise ValueError(f"the video tokens [{span.start}, {span.end}) must lie inside the "
                         f"context of {plan.context_len} tokens")
    patch_range = inputs.patch_ranges[rank]

    with torch.inference_mode():
        with timer.stage("vision"):
            local_video = inputs.vision_embeds  # set: a vision cache hit
            with agreement(group):  # reached on every rank, hit or miss
                if local_video is None:
                    if patch_range[0] == patch_range[1]:  # pruning kept none of this rank's
                        local_video = torch.zeros(
                            0, model.text_config.hidden_size * (1 + model.extra_levels),
                            dtype=model.dtype, device=model.device)
                    elif inputs.frame_chunks is not None:  # vision.pipeline: decoded here
                        local_video = model.encode_frames(inputs.frame_chunks)
                    else:
                        grid = (patch_range[1] - patch_range[0], h, w)
                        assert inputs.pixel_values is not None, "no frames and no embeddings"
                        local_video = model.vision_tower(inputs.pixel_values, grid)
                    assert len(local_video) == (patch_range[1] - patch_range[0]) \
                        * span.tokens_per_patch, (local_video.shape, patch_range)
                    if inputs.vision_store is not None:
                        inputs.vision_store(local_video)
                    if inputs.kept_tokens is not None:  # per-token pruning: after the tower
                        rows = inputs.kept_tokens[patch_range[0]:patch_range[1]].flatten()
                        local_video = local_video[rows.to(local_video.device)]
                cancel = cancelled_here(stop, info, "the prefill")
                if cancel is not None:
                    raise cancel
            assert local_video is not None
            cache_hit = not comm.any_rank(inputs.vision_embeds is None, group)
        with timer.stage("transfer"):
            encoded = encoded_tokens(inputs, span.tokens_per_patch)
            routes = token_routes(plan, span, encoded)
            if mode.vit_split:
                video_rows = route_embeddings(local_video, routes, encoded[rank], rank, group)
            else:  # every rank encoded the whole video: take its own rows, move nothing
                pieces = [local_video[s:e] for s, e in needed_video_tokens(plan, span, rank)]
                # none where this rank's part of a short prompt holds no video token
                video_rows = torch.cat(pieces) if pieces else local_video[:0]
        with timer.stage("prefill"):
            local_ids = shard(ids.unsqueeze(0), plan, rank)
            embeds = model.embed(local_ids)
            is_video = (local_ids == model.video_token_id).to(embeds.device)
            assert int(is_video.sum()) == video_rows.shape[0], (int(is_video.sum()),
                                                                 video_rows.shape)
            video_rows, features = split_features(model, video_rows, is_video)
            embeds[is_video] = video_rows.to(embeds.dtype)
            positions = inputs.positions if inputs.positions is not None else \
                model.positions(ids, inputs.video_grid, inputs.second_per_grid_t, inputs.kept)
            local_positions = shard(positions, plan, rank, dim=2)
            logits, cache = prefill(model, embeds, local_positions, plan, info,
                                    overlap=mode.overlap, kernel=request.kernel,
                                    reserve=kv_reserve(request.max_new_tokens, choice_ids),
                                    video_features=features)
    mark = cache.lengths()  # the prompt: where an n > 1 request's next answer starts
    next_position = int(positions.max()) + 1
    answer = finish_answer(model, logits, next_position, cache, info, timer, request,
                           DecodeSettings(request.kernel, graphs if request.n == 1 else None,
                                          on_token, stop), choice_ids=choice_ids)
    others = None
    if request.n > 1 and answer.finish != "cancelled":
        others = []
        scratch = StageTimer(timer.device, timer.group)  # TTFT is the first answer's
        with timer.stage("other_answers"):
            for index in range(1, request.n):
                cache.truncate(mark)
                more = finish_answer(model, logits, next_position, cache, info, scratch, request,
                                     DecodeSettings(request.kernel, stop=stop),
                                     sampling=request.sampling.for_answer(index))
                others.append({"answer": answer_text(model, more.tokens, None,
                                                     request.stop_texts),
                               "token_ids": more.tokens, "finish_reason": more.finish,
                               "logprobs": more.logprobs})
    row_bytes = local_video.shape[-1] * local_video.element_size()
    moved, allgather = transfer_bytes(routes, span.num_tokens, row_bytes)
    prompt = PromptStats(
        mode=mode.name, frames=inputs.num_frames, context_len=plan.context_len,
        query_len=plan.query_len, logits=logits, anchor_len=plan.anchor_len,
        passing_len=plan.passing_len, embedding_bytes=moved if mode.vit_split else 0,
        allgather_bytes=allgather, vision_cache_hit=cache_hit, snapped=inputs.snapped)
    return build_result(model, request, answer, prompt, info, timer, cache, others=others)


def encoded_tokens(inputs: PromptInputs, per_patch: int) -> list[Range]:
    """Per rank, the prompt's video tokens [a, b) (counted over every run) that its tower rows
    become: its patches' tokens, or with per-token pruning their kept ones."""
    if inputs.kept_tokens is None:
        return [(p0 * per_patch, p1 * per_patch) for p0, p1 in inputs.patch_ranges]
    before = [0] + inputs.kept_tokens.sum(dim=1).cumsum(0).tolist()
    return [(before[p0], before[p1]) for p0, p1 in inputs.patch_ranges]


def split_features(model: VideoModel, rows: torch.Tensor, is_video: torch.Tensor,
                    ) -> tuple[torch.Tensor, VideoFeatures | None]:
    """A shard's routed tower rows (m, hidden * (1 + ``model.extra_levels``)) -> the main
    embeddings (m, hidden) and, for a family with extra levels, the :class:`VideoFeatures`
    at the shard's video tokens ``is_video`` (1, T) (else None, the rows as they are)."""
    if not model.extra_levels:
        return rows, None
    hidden = rows.shape[1] // (1 + model.extra_levels)
    assert hidden * (1 + model.extra_levels) == rows.shape[1], (rows.shape, model.extra_levels)
    levels = list(rows[:, hidden:].split(hidden, dim=1))
    return rows[:, :hidden], VideoFeatures(is_video, levels)


def build_result(
    model: VideoModel, request: Request, answer: Answer, prompt: PromptStats, info: DistInfo,
    timer: StageTimer, cache: RankKVCache, *, others: list[dict[str, Any]] | None = None,
) -> Result:
    """The :class:`Result` of an answered request (every rank; two small collectives: the
    stage times and the KV bytes, max over ranks): :func:`finish_answer`'s ``answer``, what
    ran for the ``prompt``, and with ``request.n`` > 1 the ``others``."""
    seconds = timer.max_over_ranks(info.group)
    return Result(
        answer=answer_text(model, answer.tokens, answer.choices, request.stop_texts),
        token_ids=answer.tokens,
        ttft_s=sum(seconds.get(s, 0.0) for s in TTFT_STAGES),
        seconds=seconds,
        mode=prompt.mode,
        world_size=info.world_size,
        frames=prompt.frames,
        context_len=prompt.context_len,
        query_len=prompt.query_len,
        anchor_len=prompt.anchor_len,
        passing_len=prompt.passing_len,
        embedding_bytes=prompt.embedding_bytes,
        allgather_bytes=prompt.allgather_bytes,
        kv_cache_bytes_max=int(comm.all_reduce_max(float(cache.nbytes()), info.group)),
        vision_cache_hit=prompt.vision_cache_hit,
        first_logits=prompt.logits,
        choices=answer.choices,
        finish_reason=answer.finish,
        logprobs=answer.logprobs,
        others=others,
        snapped_frames=None if prompt.snapped is None else [
            {"position": p, "frame": i, "keyframe": k} for p, i, k in prompt.snapped],
    )


def finish_answer(
    model: VideoModel, logits: torch.Tensor, next_position: int, cache: RankKVCache,
    info: DistInfo, timer: StageTimer, request: Request, settings: DecodeSettings, *,
    choice_ids: list[list[int]] | None = None, sampling: Sampling | None = None,
) -> Answer:
    """From the prompt's last ``logits`` (every rank) to the :class:`Answer` of ``request``:
    the first token (stage ``first_token``), then greedy decode (until EOS, a stop text, the
    length or ``settings.stop``: :func:`greedy_continue`) or, with ``request.choices``
    (``choice_ids``: their tokens), the choices' exact scores (stage ``decode``) and their
    table, over the distributed ``cache``; ``next_position`` is the first position after the
    prompt. ``settings``: the kernel, captured decode steps, ``on_token`` and ``stop``
    (:class:`DecodeSettings`). ``sampling`` (None: ``request.sampling``) picks the tokens; on
    the query rank, with its ``logprobs``, the answer has each generated token's
    :meth:`~apbv.engine.sampling.Sampling.record`.

    Single-token choices are scored by the first token's logits alone: no decode stage, the
    answer is ready with the first token. After scoring, the cache is back to the prompt.
    """
    sampling = request.sampling if sampling is None else sampling
    with timer.stage("first_token"):
        # stays on the device for decode
        guide = None if sampling.rules.grammar is None else \
            Guide(sampling.rules.grammar, model.processor.tokenizer)
        first_token = pick_token(logits, info.group, sampling,
                                 tuple(sorted(model.eos_token_ids)), guide)
        first = host_token(first_token, info.group)
    if request.choices is not None:  # closed vocabulary: score every choice, generate nothing
        assert choice_ids is not None
        single = all(len(c) == 1 for c in choice_ids)
        with timer.stage("first_token" if single else "decode"):
            scores = score_choices(model, logits, choice_ids, next_position, cache, info,
                                   kernel=settings.kernel)
        best = choice_ids[max(range(len(choice_ids)), key=lambda i: scores[i])]
        if settings.on_token is not None:  # the chosen answer's tokens
            for token in best:
                settings.on_token(token)
        return Answer(best, choice_table(request.choices, choice_ids, scores), "stop")
    logprobs = keeps_records(sampling, info)
    if logprobs is not None:
        logprobs.append(sampling.record(logits, first))
    if settings.on_token is not None:
        settings.on_token(reported(first, logprobs))
    with timer.stage("decode"):
        rest = greedy_continue(model, first_token, first, next_position, cache, info, request,
                               settings, sampling=sampling, guide=guide)
    if logprobs is not None:
        assert rest.logprobs is not None, "the query rank keeps the records"
        rest.logprobs[:0] = logprobs  # the first token's record first
    return rest


def answer_text(model: VideoModel, tokens: list[int], choices: list[dict] | None,
                stop_texts: Sequence[str] = ()) -> str:
    """The answer: the likeliest choice, or the tokens' text (special tokens left out) cut
    before the first stop text it holds."""
    if choices is not None:
        return max(choices, key=lambda c: c["logprob"])["text"]
    return cut_at_stop(model.processor.tokenizer.decode(tokens, skip_special_tokens=True),
                       stop_texts)[0]
