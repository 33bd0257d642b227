"""A live video stream held over the ranks: append frames as they arrive, ask at any moment.

A stream's prompt is the one a one-shot request would build on the frames so far: the chat
template's header (prefilled at open), the video tokens growing chunk by chunk, and at ``ask``
the rest of the template with the question. Every method is called on every rank alike, with
the same arguments (checked: a mismatch is a ValueError on every rank).

Appending a chunk (the whole temporal patches of one :meth:`Stream.append`; an odd last frame
waits for its pair): the chunk goes to the rank holding the fewest tokens (its *owner*), which
runs the vision tower on it and broadcasts the embeddings; every rank then feeds the chunk's
rows through the decoder (hidden states replicated, as in decode), and in each layer attends
them to the keys it holds (the owner: causally to its cache plus the chunk); the H partials
are merged by log-sum-exp (:class:`apbv.engine.decode.DecodeContext`). That is exact attention
of the chunk over everything before it, and only the owner stores the chunk's KV, so memory
stays balanced. An ``ask`` feeds the rest of the prompt the same way (owned by the query rank),
answers (greedy tokens or closed-vocabulary choices, exact) and then forgets the question's
rows and whatever decode added: the stream goes on unchanged.

M-RoPE positions are the one-shot prompt's: temporal patch g (counted from the stream's first
frame, at ``2 / fps`` seconds per patch, from the timestamps) gets temporal position
``floor(g * 2 / fps * tokens_per_second)``; text after the video starts at the maximum + 1.
So while nothing is evicted, ``ask`` returns the tokens of one-shot ``exact`` mode on the same
frames (``Request(video=DecodedVideo(frames, fps))``).

A window (``window_s``, or ``window_tokens`` per rank) evicts the oldest whole chunks and frees
their rows on the rank that held them. The survivors keep their KV and positions: they were
encoded with the older frames in view, so after an eviction the answer is no longer the
one-shot answer on the window's frames (``ask(..., fresh=True)`` gives that one: a one-shot
spava prefill of the window from the kept vision embeddings, ``keep_vision=True``). Before the
positions leave ``rebase_at`` every cached key is rotated back by the positions the evicted
chunks took (:func:`apbv.positions.rope_shift`): scores depend only on position differences,
so attention is unchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from apbv import comm
from apbv.context import active
from apbv.engine.decode import DecodeContext, choice_token_ids, decode_reserve
from apbv.engine.kvcache import RankKVCache
from apbv.engine.request import (
    PromptInputs,
    Request,
    Result,
    StreamWindow,
    check_choices,
    check_stop_texts,
)
from apbv.engine.runtime import answer_text, finish_answer, raise_if_any_failed, run_prompt
from apbv.engine.stream_spec import Chunk, StreamSpec, StreamStats, check_timestamps
from apbv.modes import get_mode
from apbv.plan import QUERY_RANK, check_int, patch_ranges
from apbv.positions import rope_shift, video_positions
from apbv.sequence import VIDEO_PAD, prompt_ids, split_prompt
from apbv.timing import TTFT_STAGES, StageTimer
from apbv.video import TEMPORAL_PATCH_SIZE

if TYPE_CHECKING:
    from apbv.engine.engine import Engine


class Stream:
    """This rank's part of one stream; build it with :meth:`apbv.engine.engine.Engine.open_stream`
    on every rank alike."""

    def __init__(self, engine: Engine, spec: StreamSpec):
        self.engine, self.spec = engine, spec
        self.qwen, self.info = engine.qwen, engine.info
        self.kernel = engine.cfg.attention.kernel
        qwen = self.qwen
        self.cache = RankKVCache(qwen.num_layers)
        self.chunks: list[Chunk] = []
        self.vision: dict[int, torch.Tensor] = {}  # chunk index -> embeddings (owner only)
        self.stats = StreamStats()
        self._pending: tuple[torch.Tensor, float] | None = None  # the odd frame
        self._t0: float | None = None  # timestamp of the first frame
        self._last_ts: float | None = None  # the newest frame's timestamp
        self._next_patch = 0
        self._chunk_index = 0
        merge = qwen.spatial_merge_size
        self.grid_hw = (spec.height // 14, spec.width // 14)
        self.tokens_per_patch = (self.grid_hw[0] // merge) * (self.grid_hw[1] // merge)
        self.rebase_at = spec.rebase_at or qwen.max_positions // 2
        context_text, _ = split_prompt(qwen.processor, "?")
        ids, _ = prompt_ids(qwen.processor.tokenizer, context_text, "?", "?", 1)
        cut = ids.tolist().index(qwen.processor.tokenizer.convert_tokens_to_ids(VIDEO_PAD))
        self.header_ids, self.after_ids = ids[:cut], ids[cut + 1:]
        self.header_len = cut
        self.tokens = [0] * self.info.world_size  # tokens each rank holds (every rank knows)
        self.max_position = cut - 1  # the largest position fed so far (after shifts)
        with torch.inference_mode():
            self._feed(qwen.embed(self.header_ids.unsqueeze(0)),
                       torch.arange(cut).expand(3, 1, -1), owner=QUERY_RANK)
        self.tokens[QUERY_RANK] += cut

    # -- what every rank knows -------------------------------------------------------------

    @property
    def frames_held(self) -> int:
        return TEMPORAL_PATCH_SIZE * sum(c.patches for c in self.chunks)

    def describe(self) -> dict[str, Any]:
        """Stats for clients (identical on every rank, no collective)."""
        held = [0] * self.info.world_size
        for c in self.chunks:
            held[c.owner] += c.tokens
        seconds_held = (self.chunks[-1].end_s - self.chunks[0].start_s
                        + 1 / self.spec.fps) if self.chunks else 0.0
        return {
            "frames_appended": self.stats.frames,
            "frames_held": self.frames_held,
            "chunks_held": len(self.chunks),
            "chunks_evicted": self.stats.evicted_chunks,
            "seconds_held": seconds_held,
            "video_tokens_per_rank": held,
            "tokens_per_rank": list(self.tokens),
            "rebases": self.stats.rebases,
            "position_shift": self.stats.shift,
            "seconds": dict(self.stats.seconds),
        }

    def _owner(self) -> int:
        return min(range(self.info.world_size), key=lambda r: (self.tokens[r], r))

    def _row_start(self, chunk: Chunk) -> int:
        """Where ``chunk``'s rows start in its owner's cache."""
        start = self.header_len if chunk.owner == QUERY_RANK else 0
        for c in self.chunks:
            if c is chunk:
                return start
            if c.owner == chunk.owner:
                start += c.tokens
        raise AssertionError(f"chunk {chunk.index} is not held")

    # -- the model ---------------------------------------------------------------------------

    def _feed(self, embeds: torch.Tensor, positions: torch.Tensor, owner: int) -> torch.Tensor:
        """Rows (1, T, hidden) at positions (3, 1, T) through the decoder, attending exactly
        to everything cached; ``owner`` keeps their KV. Returns the hidden states."""
        ctx = DecodeContext(self.info, self.cache, self.kernel, owner=owner)
        with active(ctx):
            return self.qwen.decoder(embeds, positions)

    # -- append ------------------------------------------------------------------------------

    def _check_frames(self, frames: torch.Tensor,
                      timestamps: Sequence[float]) -> tuple[torch.Tensor, list[float]]:
        spec = self.spec
        if not isinstance(frames, torch.Tensor) or frames.dtype != torch.uint8 or \
                frames.dim() != 4 or frames.shape[1] != 3:
            got = (f"{frames.dtype} {tuple(frames.shape)}" if isinstance(frames, torch.Tensor)
                   else type(frames).__name__)
            raise ValueError(f"frames must be a uint8 tensor (F, 3, H, W), got {got}")
        if tuple(frames.shape[2:]) != (spec.height, spec.width):
            raise ValueError(f"frames are {frames.shape[3]}x{frames.shape[2]}; the stream was "
                             f"opened for {spec.width}x{spec.height}")
        stamps = check_timestamps(list(timestamps), self._last_ts)
        if len(stamps) != frames.shape[0]:
            raise ValueError(f"{frames.shape[0]} frames but {len(stamps)} timestamps")
        return frames, stamps

    def _patch_indices(self, starts: list[float]) -> list[int]:
        """Temporal patch index of each new patch (first-frame timestamps ``starts``): its time
        since the first frame in patches, rounded, and always after the previous patch."""
        assert self._t0 is not None
        out, prev = [], self._next_patch - 1
        for t in starts:
            g = max(round((t - self._t0) / self.spec.seconds_per_patch), prev + 1)
            out.append(g)
            prev = g
        return out

    def _positions(self, patches: list[int]) -> torch.Tensor:
        """(3, 1, tokens) M-RoPE positions of the chunk's tokens (after the current shift)."""
        merge = self.qwen.spatial_merge_size
        return video_positions(patches, self.grid_hw[0] // merge, self.grid_hw[1] // merge,
                               self.spec.seconds_per_patch, self.qwen.tokens_per_second,
                               self.header_len - self.stats.shift).unsqueeze(1)

    def append(self, frames: torch.Tensor, timestamps: Sequence[float]) -> dict[str, Any]:
        """Add frames (uint8 (F, 3, H, W) at the stream's size) with their timestamps
        (seconds, increasing, bounded as :func:`check_timestamps` says). Whole temporal
        patches become one chunk now; an odd last frame waits for the next append. Returns
        what happened: {"chunk", "owner", "tokens", "evicted", "seconds"} (chunk None when no
        whole patch was complete)."""
        error: Exception | None = None
        try:
            frames, stamps = self._check_frames(frames, timestamps)
        except ValueError as exc:
            error = exc
        raise_if_any_failed(error, self.info.group)
        digest = hashlib.sha256(frames.contiguous().numpy().tobytes()).hexdigest()
        self.engine.check_same("frames", {"frames": digest, "timestamps": repr(stamps)})
        self.stats.frames += len(stamps)
        if stamps:
            self._last_ts = stamps[-1]
            if self._t0 is None:
                self._t0 = stamps[0]
        if self._pending is not None:
            frames = torch.cat([self._pending[0].unsqueeze(0), frames])
            stamps = [self._pending[1]] + stamps
            self._pending = None
        if len(stamps) % TEMPORAL_PATCH_SIZE:
            self._pending = (frames[-1].clone(), stamps[-1])
            frames, stamps = frames[:-1], stamps[:-1]
        if not stamps:
            return {"chunk": None, "owner": None, "tokens": 0, "evicted": 0, "seconds": {}}
        return self._append_chunk(frames, stamps)

    def _append_chunk(self, frames: torch.Tensor, stamps: list[float]) -> dict[str, Any]:
        info = self.info
        patches = self._patch_indices(stamps[::TEMPORAL_PATCH_SIZE])
        tokens = len(patches) * self.tokens_per_patch
        self._check_room(tokens)
        positions = self._positions(patches)
        if int(positions.max()) >= self.rebase_at:
            self._rebase(positions)
            positions = self._positions(patches)
        owner = self._owner()
        timer = StageTimer(info.device, info.group)
        mark = self.cache.lengths()
        try:
            embeds = self._encode_and_feed(frames, positions, tokens, owner, timer)
        except BaseException:
            self.cache.truncate(mark)  # a failed chunk leaves the stream as it was
            raise
        chunk = Chunk(self._chunk_index, owner, patches[0], len(patches), tokens, stamps[0],
                      stamps[-1], int(positions[0, 0, 0]))
        if self.spec.keep_vision and info.rank == owner:
            self.vision[chunk.index] = embeds.detach().clone()
        self.chunks.append(chunk)
        self.tokens[owner] += tokens
        self.max_position = max(self.max_position, int(positions.max()))
        self._next_patch = patches[-1] + 1
        self._chunk_index += 1
        self.stats.chunks += 1
        evicted = self._evict()
        seconds = timer.max_over_ranks(info.group)
        for name, s in seconds.items():
            self.stats.seconds[name] = self.stats.seconds.get(name, 0.0) + s
        return {"chunk": chunk.index, "owner": owner, "tokens": tokens, "evicted": evicted,
                "seconds": seconds}

    @torch.inference_mode()
    def _encode_and_feed(self, frames: torch.Tensor, positions: torch.Tensor, tokens: int,
                         owner: int, timer: StageTimer) -> torch.Tensor:
        """The owner encodes the chunk and broadcasts its embeddings (tokens, hidden); every
        rank feeds them; the owner keeps their KV."""
        qwen, group = self.qwen, self.info.group
        with timer.stage("vision"):
            error, embeds = None, None
            if self.info.rank == owner:
                try:
                    pixel_values, grid = qwen.tower_rows(frames)
                    embeds = qwen.vision_tower(pixel_values, grid)
                except Exception as exc:  # e.g. out of memory on the owner only
                    error = exc
            raise_if_any_failed(error, group)
        with timer.stage("transfer"):
            if embeds is None:
                embeds = torch.empty(tokens, qwen.text_config.hidden_size, dtype=qwen.dtype,
                                     device=qwen.device)
            embeds = comm.broadcast(embeds.to(qwen.dtype), src=owner, group=group)
        with timer.stage("prefill"):
            self._feed(embeds.unsqueeze(0), positions, owner=owner)
        return embeds

    def _check_room(self, tokens: int) -> None:
        """ValueError (on every rank alike) when the stream would pass the model's context."""
        held, limit = sum(self.tokens), self.qwen.max_positions
        if held + tokens > limit:
            raise ValueError(
                f"the stream holds {held} tokens and a chunk of {tokens} would pass the "
                f"model's context of {limit}: open the stream with a window (window_s or "
                f"window_tokens)")

    @torch.inference_mode()  # the cached tensors are inference tensors
    def _evict(self) -> int:
        spec, evicted = self.spec, 0
        world = self.info.world_size
        while len(self.chunks) > 1:
            oldest, newest = self.chunks[0], self.chunks[-1]
            video = sum(c.tokens for c in self.chunks)
            too_old = spec.window_s is not None and \
                newest.end_s - oldest.end_s >= spec.window_s
            too_many = spec.window_tokens is not None and video > spec.window_tokens * world
            if not (too_old or too_many):
                break
            if self.info.rank == oldest.owner:
                start = self._row_start(oldest)
                self.cache.drop(start, start + oldest.tokens)
                self.vision.pop(oldest.index, None)
            self.tokens[oldest.owner] -= oldest.tokens
            self.chunks.pop(0)
            evicted += 1
        self.stats.evicted_chunks += evicted
        return evicted

    @torch.inference_mode()
    def _rebase(self, positions: torch.Tensor) -> None:
        """Move every cached position back so the oldest held chunk starts right after the
        header (every rank rotates its own keys)."""
        shift = self.chunks[0].first_position - self.header_len if self.chunks else 0
        if shift <= 0 or int(positions.max()) - shift >= self.rebase_at:
            raise ValueError(
                f"the stream's positions reached {int(positions.max())}, past "
                f"{self.rebase_at}, and re-basing cannot bring them back (nothing old enough "
                "was evicted): open the stream with a smaller window")
        inv_freq = self.qwen.rope_inv_freq
        self.cache.map_keys(lambda k: rope_shift(k, -shift, inv_freq))
        for c in self.chunks:
            c.first_position -= shift
        self.max_position -= shift
        self.stats.shift += shift
        self.stats.rebases += 1

    # -- ask ---------------------------------------------------------------------------------

    def ask(self, question: str, *, max_new_tokens: int = 1,
            choices: Sequence[str] | None = None, fresh: bool = False,
            on_token: Callable[[int], None] | None = None,
            stop: Callable[[], bool] | None = None,
            stop_texts: str | Sequence[str] = ()) -> Result:
        """Answer ``question`` about the frames appended so far (whole patches; the buffered
        odd frame waits for its pair). Exact attention over the held KV; the question's rows
        and the decoded tokens are dropped afterwards. ``fresh``: a one-shot spava prefill of
        the held window from the kept vision embeddings instead (``keep_vision``). ``stop``
        as in :meth:`Engine.generate <apbv.engine.engine.Engine.generate>`, ``stop_texts`` as
        in :class:`~apbv.engine.request.Request`."""
        error: Exception | None = None
        try:
            if not isinstance(question, str) or not question.strip():
                raise ValueError("the question must be a non-empty string")
            check_int("max_new_tokens", max_new_tokens, 1)
            if choices is not None:
                choices = check_choices(choices)
            stop_texts = check_stop_texts(stop_texts, choices)
            if not self.chunks:
                raise ValueError("the stream holds no frames yet: append at least one whole "
                                 f"temporal patch ({TEMPORAL_PATCH_SIZE} frames) first")
            if fresh and not self.spec.keep_vision:
                raise ValueError("ask(fresh=True) needs the vision embeddings: open the stream "
                                 "with keep_vision=True")
        except ValueError as exc:
            error = exc
        raise_if_any_failed(error, self.info.group)
        self.engine.check_same("questions", {"question": question, "choices": repr(choices),
                                            "max_new_tokens": str(max_new_tokens),
                                            "fresh": str(fresh), "stop": repr(stop_texts)})
        if fresh:
            return self._ask_fresh(question, max_new_tokens, choices, on_token, stop,
                                   stop_texts)
        qwen, info = self.qwen, self.info
        timer = StageTimer(info.device, info.group)
        tokenizer = qwen.processor.tokenizer
        with timer.stage("preprocess"):
            _, query_text = split_prompt(qwen.processor, question)
            _, query_ids = prompt_ids(tokenizer, VIDEO_PAD, query_text, question, 0)
            rows = torch.cat([self.after_ids, query_ids])
            choice_ids = None if choices is None else choice_token_ids(tokenizer, choices)
            reserve, what = decode_reserve(max_new_tokens, choice_ids)
            held = sum(self.tokens)
            if held + len(rows) + reserve > qwen.max_positions or \
                    self.max_position + len(rows) + reserve >= qwen.max_positions:
                raise ValueError(
                    f"the stream's {held} tokens, the question's {len(rows)} and {what} "
                    f"({reserve}) pass the model's context of {qwen.max_positions}")
        mark = self.cache.lengths()
        start = self.max_position + 1
        try:
            with torch.inference_mode():
                if info.rank == QUERY_RANK:  # the owner of the question's and answer's rows
                    self.cache.make_room(len(rows) + reserve)
                with timer.stage("prefill"):
                    positions = torch.arange(start, start + len(rows)).expand(3, 1, -1)
                    hidden = self._feed(qwen.embed(rows.unsqueeze(0)), positions,
                                        owner=QUERY_RANK)
                    logits = qwen.logits(hidden[0, -1]).float()
            tokens, table, finish = finish_answer(
                qwen, logits, start + len(rows), self.cache, info, timer, choices=choices,
                choice_ids=choice_ids, max_new_tokens=max_new_tokens, kernel=self.kernel,
                on_token=on_token, stop=stop, stop_texts=stop_texts,
                graphs=self.engine.decode_graphs)
        finally:
            self.cache.truncate(mark)
        seconds = timer.max_over_ranks(info.group)
        return Result(
            answer=answer_text(qwen, tokens, table, stop_texts),
            token_ids=tokens,
            ttft_s=sum(seconds.get(s, 0.0) for s in TTFT_STAGES),
            seconds=seconds,
            mode="stream",
            world_size=info.world_size,
            frames=self.frames_held,
            context_len=held,
            query_len=len(rows),
            anchor_len=0,
            passing_len=0,
            embedding_bytes=0,
            allgather_bytes=0,
            kv_cache_bytes_max=int(comm.all_reduce_max(float(self.cache.nbytes()), info.group)),
            choices=table,
            first_logits=logits,
            finish_reason=finish,
        )

    def _ask_fresh(self, question: str, max_new_tokens: int, choices: Sequence[str] | None,
                   on_token: Callable[[int], None] | None,
                   stop: Callable[[], bool] | None, stop_texts: str | Sequence[str]) -> Result:
        """One-shot spava over the held chunks' frames, from the kept vision embeddings."""
        qwen, info, engine = self.qwen, self.info, self.engine
        att = engine.cfg.attention
        window = StreamWindow(self.chunks[0].index, self.chunks[-1].index, self.frames_held)
        request = Request(video=window, question=question, mode=get_mode("spava"),
                          max_new_tokens=max_new_tokens, anchor_len=att.anchor_len,
                          passing_len=att.passing_len, kernel=att.kernel,
                          choices=choices,  # type: ignore[arg-type]  # made a tuple on init
                          stop_texts=stop_texts)  # type: ignore[arg-type]  # the same
        timer = StageTimer(info.device, info.group)
        with timer.stage("preprocess"):
            error: Exception | None = None
            owned = {i: e.cpu() for i, e in self.vision.items()}
            gathered: dict[int, torch.Tensor] = {}
            for part in comm.all_gather_object(owned, info.group):
                gathered.update(part)
            t = sum(c.patches for c in self.chunks)
            try:
                video = torch.cat([gathered[c.index] for c in self.chunks])
                ranges = patch_ranges(t, info.world_size)
                p0, p1 = ranges[info.rank]
                tokenizer = qwen.processor.tokenizer
                _, query_text = split_prompt(qwen.processor, question)
                _, query_ids = prompt_ids(tokenizer, VIDEO_PAD, query_text, question, 0)
                pad = tokenizer.convert_tokens_to_ids(VIDEO_PAD)
                context_ids = torch.cat([self.header_ids, torch.full((len(video),), pad),
                                         self.after_ids])
                choice_ids = None if choices is None else choice_token_ids(tokenizer, choices)
                engine.check_fits(request, len(context_ids), len(query_ids), (p0, p1),
                                  self.grid_hw, choice_ids=choice_ids)
            except ValueError as exc:
                error = exc
            raise_if_any_failed(error, info.group)
        inputs = PromptInputs(
            context_ids=context_ids, query_ids=query_ids, video_grid=(t, *self.grid_hw),
            second_per_grid_t=self.spec.seconds_per_patch, patch_ranges=tuple(ranges),
            pixel_values=None, num_frames=TEMPORAL_PATCH_SIZE * t, choice_ids=choice_ids,
            vision_embeds=video[p0 * self.tokens_per_patch:p1 * self.tokens_per_patch]
            .to(qwen.device))
        return run_prompt(qwen, inputs, request, info, timer, on_token, stop,
                          graphs=self.engine.decode_graphs)

    def close(self) -> None:
        """Free this rank's KV and kept embeddings (no collective)."""
        self.cache = RankKVCache(self.qwen.num_layers)
        self.vision.clear()
        self.chunks.clear()

