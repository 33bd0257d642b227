"""A question about a live stream: a :class:`~apbv.engine.request.Request` whose video is a
:class:`~apbv.engine.request.StreamRef`, answered by :meth:`apbv.engine.engine.Engine.generate`
with the one-shot request's checks, fingerprint, context rule and :class:`Result` builder.

- Held KV (``fresh=False``, mode ``exact``): the rest of the chat template and the question
  are fed as rows owned by the query rank, attending exactly to everything the ranks hold
  (:meth:`apbv.engine.stream.Stream.feed`); the answer is decoded over the same cache and
  then the question's rows and the decoded tokens are forgotten (:func:`run_on_stream`).
- Fresh (``fresh=True``): a one-shot prefill of the held window in the request's mode, from
  the chunks' kept vision embeddings (:func:`window_inputs`, then
  :func:`apbv.engine.runner.run_prompt`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from apbv.distributed import DistInfo
from apbv.engine.answer import DecodeSettings, PromptStats
from apbv.engine.choice_tree import kv_reserve
from apbv.engine.decode import choice_token_ids
from apbv.engine.request import PromptInputs, Request, Result, StreamRef
from apbv.engine.runner import build_result, check_context, finish_answer
from apbv.engine.stream import Stream
from apbv.model.adapter import VideoModel
from apbv.plan import QUERY_RANK, patch_ranges
from apbv.timing import StageTimer

HELD_MODE = "exact"
"""The mode of a question over a stream's held KV: exact attention over the held cache."""

if TYPE_CHECKING:
    from apbv.engine.decode_graph import GraphSteps


@dataclass(frozen=True)
class HeldAsk:
    """A question over a stream's held KV, as this rank feeds it."""

    rows: torch.Tensor
    """(R,) int64: the template's rest after the video, the question and the assistant
    header."""
    choice_ids: list[list[int]] | None
    """With ``Request.choices``: each choice's tokens (plain text)."""


def asked_stream(streams: Mapping[str, Stream], request: Request, rank: int) -> Stream:
    """The stream ``request`` asks about, or ValueError when it is not open on this ``rank``,
    holds no frames yet, or cannot answer the way the request asks (a held-KV ask is mode
    ``exact``; a fresh one needs the kept vision embeddings; no system text)."""
    ref = request.video
    assert isinstance(ref, StreamRef), ref
    stream = streams.get(ref.stream_id)
    if stream is None:
        raise ValueError(f"no stream {ref.stream_id[:64]!r} on rank {rank}")
    if not stream.chunks:
        raise ValueError("the stream holds no frames yet: append at least one whole "
                         f"temporal patch ({stream.unit} frames) first")
    if request.system is not None:
        raise ValueError("a stream's prompt took the chat template's default system turn when "
                         "it was opened: a question about it takes no system text")
    if ref.fresh and stream.pruner.threshold > 0:
        raise ValueError("a fresh stream ask reads the held window as one video without gaps; "
                         "a stream with temporal pruning (static_threshold > 0) holds its "
                         "kept patches only: ask over the held KV (fresh=False), or open the "
                         "stream with static_threshold 0")
    if ref.fresh and not stream.spec.keep_vision:
        raise ValueError("a fresh stream ask needs the vision embeddings: open the stream "
                         "with keep_vision=True")
    if not ref.fresh and request.mode.name != HELD_MODE:
        raise ValueError(f"a question over a stream's held KV is exact attention: ask it in "
                         f"mode {HELD_MODE!r}, not {request.mode.name!r} (or with fresh=True "
                         f"for a one-shot prefill of the held window in mode "
                         f"{request.mode.name!r})")
    return stream


def held_ask(model: VideoModel, stream: Stream, request: Request) -> HeldAsk:
    """The rows a held-KV question feeds, checked against the model's context
    (:func:`apbv.engine.runner.check_context`: everything the stream holds, or its positions
    when they went past that, is the context)."""
    tokenizer = model.processor.tokenizer
    rows = torch.cat([stream.after_ids, stream.query_ids(request.question)])
    choice_ids = None if request.choices is None else \
        choice_token_ids(tokenizer, request.choices)
    check_context(request, stream.context_len, len(rows), choice_ids, model.max_positions)
    return HeldAsk(rows, choice_ids)


def window_inputs(model: VideoModel, stream: Stream, request: Request, info: DistInfo,
                  video: torch.Tensor) -> PromptInputs:
    """The one-shot prompt on the held window as this rank holds it: ``video`` is every held
    chunk's vision embeddings (:meth:`Stream.kept_vision`), of which this rank keeps its share
    of the frame split (all of them when the mode does not split the vision work)."""
    t, tokens_per_patch = sum(c.patches for c in stream.chunks), stream.tokens_per_patch
    ranges = patch_ranges(t, info.world_size) if request.mode.vit_split else \
        ((0, t),) * info.world_size
    p0, p1 = ranges[info.rank]
    choice_ids = None if request.choices is None else \
        choice_token_ids(model.processor.tokenizer, request.choices)
    return PromptInputs(
        context_ids=stream.window_ids(), query_ids=stream.query_ids(request.question),
        video_grid=(t, *stream.grid_hw), second_per_grid_t=stream.seconds_per_patch,
        patch_ranges=tuple(ranges), pixel_values=None, num_frames=stream.unit * t,
        choice_ids=choice_ids,
        vision_embeds=video[p0 * tokens_per_patch:p1 * tokens_per_patch].to(model.device))


def run_on_stream(
    model: VideoModel, stream: Stream, held: HeldAsk, request: Request, info: DistInfo,
    timer: StageTimer, on_token: Callable[[int], None] | None = None,
    stop: Callable[[], bool] | None = None, *, graphs: GraphSteps | None = None,
) -> Result:
    """Answer a held-KV question (``held``: its rows) over ``stream``'s cache, exactly, then
    forget its rows and the decoded tokens; ``on_token``, ``stop`` and ``graphs`` as in
    :func:`apbv.engine.runner.run_prompt`. The stream's kernel serves its rows."""
    rows, cache = held.rows, stream.cache
    reserve = kv_reserve(request.max_new_tokens, held.choice_ids)
    mark = cache.lengths()
    start = stream.max_position + 1
    try:
        with torch.inference_mode():
            if info.rank == QUERY_RANK:  # the owner of the question's and answer's rows
                cache.make_room(len(rows) + reserve)
            with timer.stage("prefill"):
                positions = torch.arange(start, start + len(rows)).expand(3, 1, -1)
                hidden = stream.feed(model.embed(rows.unsqueeze(0)), positions, owner=QUERY_RANK)
                logits = model.logits(hidden[0, -1]).float()
        answer = finish_answer(
            model, logits, start + len(rows), cache, info, timer, request,
            DecodeSettings(stream.kernel, None if graphs is None else graphs.unkept(),
                           on_token, stop), choice_ids=held.choice_ids)
    finally:
        cache.truncate(mark)
    prompt = PromptStats(mode=HELD_MODE, frames=stream.frames_held,
                         context_len=sum(stream.tokens), query_len=len(rows), logits=logits)
    return build_result(model, request, answer, prompt, info, timer, cache)
