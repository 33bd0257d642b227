"""A live video stream held over the ranks: append frames as they arrive, ask at any moment.

A stream's prompt is the one a one-shot request would build on the frames so far: the chat
template's header (prefilled at open), the frames' rows growing chunk by chunk, and at an ask
(a :class:`~apbv.engine.request.Request` whose video is a
:class:`~apbv.engine.request.StreamRef`, answered by :mod:`apbv.engine.stream_ask`) the rest of
the template with the question. The engine holds its streams by id
(:meth:`apbv.engine.engine.Engine.open_stream`); every method is called on every rank alike,
with the same arguments (checked: a mismatch is a ValueError on every rank). The pure
bookkeeping (owners, row starts, eviction, patch indices) is :mod:`apbv.engine.stream_plan`;
the prompt's pieces and their positions are the model family's
(:meth:`apbv.model.adapter.VideoModel.stream_prompt`): this module builds neither.

Appending a chunk (the whole temporal units of one :meth:`Stream.append`, the family's
:attr:`~apbv.model.adapter.VideoModel.temporal_patch_size` frames each; a last frame short of a
unit waits for the next append): the chunk goes to the rank holding the fewest tokens (its
*owner*), which runs the vision tower on it and broadcasts the embeddings; every rank then
feeds the chunk's rows (its video tokens, and the family's text around its frames, e.g.
InternVL3's ``FrameN: <img>...</img>``) through the decoder (hidden states replicated, as in
decode), and in each layer attends them to the keys it holds (the owner: causally to its cache
plus the chunk); the H partials are merged by log-sum-exp
(:class:`apbv.engine.decode.DecodeContext`). That is exact attention of the chunk over
everything before it, and only the owner stores the chunk's KV, so memory stays balanced. An
ask feeds the rest of the prompt the same way (owned by the query rank), answers (greedy tokens
or closed-vocabulary choices, exact) and then forgets the question's rows and whatever decode
added: the stream goes on unchanged.

Positions are the one-shot prompt's: for Qwen2.5-VL's M-RoPE, temporal patch g (counted from
the stream's first frame, at ``2 / fps`` seconds per patch, from the timestamps) gets temporal
position ``floor(g * 2 / fps * tokens_per_second)``; for a 1-D family (InternVL3) the rows
follow each other; for Qwen3-VL each temporal patch's ``<t seconds>`` text (its frames' mean
capture time since the stream's first frame) and markers follow each other and its tokens are
a one-frame grid after them (interleaved M-RoPE); text after the video starts at the maximum
+ 1. A family's extra vision features (Qwen3-VL's DeepStack levels) travel with a chunk's
embeddings and are added at its video tokens as in the one-shot prefill. So while nothing is
evicted, an ask returns the tokens of one-shot ``exact`` mode on the same frames
(``Request(video=DecodedVideo(frames, fps))``).

With a static threshold (the spec's, else ``video.static_threshold``) a chunk's temporal
patches unchanged since the last kept patch are dropped before the tower
(:mod:`apbv.engine.stream_prune`): a chunk keeping none adds no tokens, the kept patches keep
the positions and text of their capture time (an ask equals one-shot exact, same threshold).

A window (``window_s``, or ``window_tokens`` per rank) evicts the oldest whole chunks and frees
their rows on the rank that held them. The survivors keep their KV and positions: they were
encoded with the older frames in view, so after an eviction the answer is no longer the
one-shot answer on the window's frames (``StreamRef(id, fresh=True)`` gives that one: a
one-shot prefill of the window in the request's mode from the kept vision embeddings,
``keep_vision=True``). Before the
positions leave ``rebase_at`` every cached key is rotated back by the positions the evicted
chunks took (:func:`apbv.positions.rope_shift`): scores depend only on position differences,
so attention is unchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from apbv import comm
from apbv.context import active
from apbv.distributed import DistInfo
from apbv.engine.agree import agreement, check_same
from apbv.engine.decode import DecodeContext
from apbv.engine.kvcache import RankKVCache
from apbv.engine.runner import split_features
from apbv.engine.stream_plan import (
    Appended,
    Chunk,
    StreamInfo,
    StreamSpec,
    StreamStats,
    check_room,
    check_timestamps,
    evictions,
    patch_indices,
    pick_owner,
    row_start,
    unit_times,
)
from apbv.engine.stream_prune import ChunkPruner, whole_units
from apbv.model.adapter import VideoFeatures, VideoModel
from apbv.model.stream_prompt import ChunkPlace
from apbv.plan import QUERY_RANK
from apbv.positions import rope_shift
from apbv.timing import StageTimer
from apbv.video import Sampling


class Stream:
    """This rank's part of one stream; the engine opens it on every rank alike
    (:meth:`apbv.engine.engine.Engine.open_stream`). ``kernel``: the attention kernel backend
    its rows use (None: the best available)."""

    def __init__(self, model: VideoModel, info: DistInfo, spec: StreamSpec, *,
                 kernel: str | None = None):
        self.spec, self.model, self.info, self.kernel = spec, model, info, kernel
        multiple = model.frame_multiple
        if spec.height % multiple or spec.width % multiple:
            raise ValueError(f"a {model.family} stream's frames are {spec.width}x{spec.height}; "
                             f"both sides must be multiples of {multiple} (its frame_multiple)")
        self.cache = RankKVCache(model.num_layers)
        self.chunks: list[Chunk] = []
        self.vision: dict[int, torch.Tensor] = {}  # chunk index -> embeddings (owner only)
        self.stats = StreamStats()
        self._pending: tuple[torch.Tensor, float] | None = None  # the odd frame
        self._t0: float | None = None  # timestamp of the first frame
        self._last_ts: float | None = None  # the newest frame's timestamp
        self._next_patch = 0
        self._chunk_index = 0
        self._frames_fed = 0  # frames in every chunk so far (evicted ones included)
        self.unit = model.temporal_patch_size  # frames per temporal unit (a patch)
        self.seconds_per_patch = self.unit / spec.fps
        merge = model.spatial_merge_size
        _, *hw = model.video_grid(self._sampling(1))
        self.grid_hw = (hw[0], hw[1])
        self.tokens_per_patch = (self.grid_hw[0] // merge) * (self.grid_hw[1] // merge)
        self.pruner = ChunkPruner(spec.static_threshold or 0.0, self.unit,
                                  (self.grid_hw[0] // merge, self.grid_hw[1] // merge))
        self.rebase_at = spec.rebase_at or model.max_positions // 2
        self.prompt = model.stream_prompt(self.grid_hw)
        self.header_ids, self.after_ids = self.prompt.header, self.prompt.after
        self.header_len = cut = len(self.header_ids)
        self.tokens = [0] * self.info.world_size  # tokens each rank holds (every rank knows)
        self.max_position = cut - 1  # the largest position fed so far (after shifts)
        with torch.inference_mode():
            self.feed(model.embed(self.header_ids.unsqueeze(0)),
                       torch.arange(cut).expand(3, 1, -1), owner=QUERY_RANK)
        self.tokens[QUERY_RANK] += cut

    # -- what every rank knows -------------------------------------------------------------

    @property
    def frames_held(self) -> int:
        return self.unit * sum(c.patches for c in self.chunks)

    @property
    def context_len(self) -> int:
        """What a question's rows come after, for the model's context rule: the tokens held,
        or the positions taken when they went past that (a pause in the timestamps skips
        positions)."""
        return max(sum(self.tokens), self.max_position + 1)

    def describe(self) -> StreamInfo:
        """Stats for clients (identical on every rank, no collective)."""
        held = [0] * self.info.world_size
        for c in self.chunks:
            held[c.owner] += c.tokens
        seconds_held = (self.chunks[-1].end_s - self.chunks[0].start_s
                        + 1 / self.spec.fps) if self.chunks else 0.0
        return StreamInfo(
            frames_appended=self.stats.frames, frames_held=self.frames_held,
            chunks_held=len(self.chunks), chunks_evicted=self.stats.evicted_chunks,
            seconds_held=seconds_held, video_tokens_per_rank=held,
            tokens_per_rank=list(self.tokens), rebases=self.stats.rebases,
            position_shift=self.stats.shift, seconds=dict(self.stats.seconds),
            patches_pruned=self.stats.patches_pruned, static_threshold=self.pruner.threshold,
            pruning_grid=(self.unit, *self.pruner.cells))

    # -- the model ---------------------------------------------------------------------------

    def feed(self, embeds: torch.Tensor, positions: torch.Tensor, owner: int,
             video_features: VideoFeatures | None = None) -> torch.Tensor:
        """Rows (1, T, hidden) at positions (3, 1, T) through the decoder, attending exactly
        to everything cached; ``owner`` keeps their KV; ``video_features``: the rows' extra
        vision features (DeepStack), as the one-shot prefill passes them. Returns the hidden
        states."""
        ctx = DecodeContext(self.info, self.cache, self.kernel, owner=owner)
        with active(ctx):
            return self.model.decoder(embeds, positions) if video_features is None else \
                self.model.decoder(embeds, positions, video_features)

    # -- append ------------------------------------------------------------------------------

    def _check_frames(self, frames: torch.Tensor, timestamps: Sequence[float],
                      last: float | None) -> tuple[torch.Tensor, list[float]]:
        spec = self.spec
        if not isinstance(frames, torch.Tensor) or frames.dtype != torch.uint8 or \
                frames.dim() != 4 or frames.shape[1] != 3:
            got = (f"{frames.dtype} {tuple(frames.shape)}" if isinstance(frames, torch.Tensor)
                   else type(frames).__name__)
            raise ValueError(f"frames must be a uint8 tensor (F, 3, H, W), got {got}")
        if tuple(frames.shape[2:]) != (spec.height, spec.width):
            raise ValueError(f"frames are {frames.shape[3]}x{frames.shape[2]}; the stream was "
                             f"opened for {spec.width}x{spec.height}")
        stamps = check_timestamps(list(timestamps), last)
        if len(stamps) != frames.shape[0]:
            raise ValueError(f"{frames.shape[0]} frames but {len(stamps)} timestamps")
        return frames, stamps

    def _chunk_rows(self, patches: list[int], stamps: list[float],
                    frames: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """(R,) ids and (3, 1, R) positions of a chunk of temporal units ``patches`` whose
        frames were captured at ``stamps`` (seconds; after the current shift) and whose first
        frames have the numbers ``frames`` (empty: they follow the frames fed), from the
        family (:class:`apbv.model.stream_prompt.StreamPrompt`)."""
        assert self._t0 is not None
        return self.prompt.chunk(ChunkPlace(
            self._frames_fed, patches, self.seconds_per_patch,
            self.header_len - self.stats.shift, self.max_position + 1,
            seconds=tuple(unit_times(stamps, self._t0, self.unit)), frames=tuple(frames)))

    def _sampling(self, units: int) -> Sampling:
        """``units`` temporal units of frames at the stream's size and fps (frame i at i / fps
        seconds): the one-shot sampling of a decoded-frame video of them."""
        spec = self.spec
        return Sampling(tuple(range(units * self.unit)), spec.fps, spec.height, spec.width,
                        temporal_patch_size=self.unit, video_fps=spec.fps)

    def query_ids(self, question: str) -> torch.Tensor:
        """(Q,) the family's query ids for ``question`` (the one-shot prompt's)."""
        return self.model.prompt(question, (1, *self.grid_hw), sampling=self._sampling(1))[1]

    def append(self, frames: torch.Tensor, timestamps: Sequence[float],
               held: Sequence[tuple[torch.Tensor, Sequence[float]]] = ()) -> Appended:
        """Add frames (uint8 (F, 3, H, W) at the stream's size) with their timestamps
        (seconds, increasing, bounded as :func:`check_timestamps` says). Whole temporal
        patches become one chunk now; an odd last frame waits for the next append. Returns
        what happened (its chunk None when no whole patch was complete). ``held``: pushes the
        server held (:mod:`apbv.serve.streams.hold`: none keeps a patch, checked), checked with
        the frames and appended first, each alone, in order; one the stream already has (a
        resend: its last timestamp not past the newest) skipped."""
        checked, last = [], self._last_ts
        with agreement(self.info.group):
            for past, stamps in [*[(f, t) for f, t in held if last is None or t[-1] > last],
                                 (frames, timestamps)]:
                checked.append(self._check_frames(past, stamps, last))
                last = checked[-1][1][-1] if checked[-1][1] else last
        digest = hashlib.sha256(b"".join(f.contiguous().numpy().tobytes() for f, _ in checked))
        check_same("frames", {"frames": digest.hexdigest(),
                              "timestamps": repr([t for _, t in checked])}, self.info.group)
        for past, stamps in checked[:-1]:
            done = self._take(past, stamps)
            assert done.chunk is None, f"a push the server held keeps a patch: {done}"
        return self._take(*checked[-1])

    def _take(self, frames: torch.Tensor, stamps: list[float]) -> Appended:  # checked ones
        self.stats.frames += len(stamps)
        if stamps:
            self._last_ts = stamps[-1]
            if self._t0 is None:
                self._t0 = stamps[0]
        frames, stamps, self._pending = whole_units(self._pending, frames, stamps, self.unit)
        if not stamps:
            return Appended(chunk=None, owner=None, tokens=0, evicted=0)
        return self._append_chunk(frames, stamps)

    def _append_chunk(self, frames: torch.Tensor, stamps: list[float]) -> Appended:
        info = self.info
        assert self._t0 is not None
        starts = stamps[::self.unit]
        patches = patch_indices(starts, self._t0, self.seconds_per_patch, self._next_patch)
        judged, fed, every = self.pruner.judge(frames), len(stamps), len(patches)
        units, next_patch = judged.units, patches[-1] + 1
        numbers: tuple[int, ...] = ()
        if not units:  # nothing changed: no tokens, but the patches' time passes
            self._next_patch, self._frames_fed = next_patch, self._frames_fed + fed
            self.stats.patches_pruned += every
            return Appended(chunk=None, owner=None, tokens=0, evicted=0, patches=every)
        if len(units) < every:  # the kept patches alone, at their own times and numbers
            index = ChunkPruner.frame_index(judged, self.unit)
            frames, stamps = frames[index], [stamps[i] for i in index]
            numbers = tuple(self._frames_fed + u * self.unit for u in units)
            patches = [patches[u] for u in units]
        ids, positions = self._chunk_rows(patches, stamps, numbers)
        tokens = len(ids)
        check_room(sum(self.tokens), tokens, self.model.max_positions)
        if int(positions.max()) >= self.rebase_at:
            self._rebase(positions)
            ids, positions = self._chunk_rows(patches, stamps, numbers)
        owner = pick_owner(self.tokens)
        timer = StageTimer(info.device, info.group)
        mark = self.cache.lengths()
        try:
            embeds = self._encode_and_feed(frames, ids, positions, owner, timer)
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
        self._next_patch, self._frames_fed = next_patch, self._frames_fed + fed
        self.pruner.commit(judged)
        self._chunk_index += 1
        self.stats.chunks += 1
        self.stats.patches_pruned += every - len(units)
        evicted = self._evict()
        seconds = timer.max_over_ranks(info.group)
        for name, s in seconds.items():
            self.stats.seconds[name] = self.stats.seconds.get(name, 0.0) + s
        return Appended(chunk=chunk.index, owner=owner, tokens=tokens, evicted=evicted,
                        seconds=seconds, patches=every, kept=len(units))

    @torch.inference_mode()
    def _encode_and_feed(self, frames: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                         owner: int, timer: StageTimer) -> torch.Tensor:
        """The owner encodes the chunk and broadcasts its tower rows (video tokens, hidden *
        (1 + ``extra_levels``)); every rank feeds the chunk's rows ``ids`` (R,), the main
        embeddings in place of its video tokens and the extra levels (DeepStack) added at
        them as the one-shot prefill adds them (:func:`apbv.engine.runner.split_features`);
        the owner keeps their KV. Returns the tower rows."""
        model, group = self.model, self.info.group
        video = ids == model.video_token_id
        tokens = int(video.sum())
        with timer.stage("vision"):
            embeds = None
            with agreement(group):  # e.g. out of memory on the owner only
                if self.info.rank == owner:
                    pixel_values, grid = model.tower_rows(frames)
                    embeds = model.vision_tower(pixel_values, grid)
        with timer.stage("transfer"):
            if embeds is None:
                width = model.text_config.hidden_size * (1 + model.extra_levels)
                embeds = torch.empty(tokens, width, dtype=model.dtype, device=model.device)
            embeds = comm.broadcast(embeds.to(model.dtype), src=owner, group=group)
        with timer.stage("prefill"):
            main, features = split_features(model, embeds, video.unsqueeze(0))
            if bool(video.all()):  # the rows are the video tokens alone
                rows = main.unsqueeze(0)
            else:
                rows = model.embed(ids.unsqueeze(0))
                rows[0, video.to(rows.device)] = main.to(rows.dtype)
            self.feed(rows, positions, owner=owner, video_features=features)
        return embeds

    @torch.inference_mode()  # the cached tensors are inference tensors
    def _evict(self) -> int:
        """Drop the oldest chunks the window no longer holds (:func:`evictions`)."""
        evicted = evictions(self.chunks, self.spec, self.info.world_size)
        for _ in range(evicted):
            oldest = self.chunks[0]
            if self.info.rank == oldest.owner:
                start = row_start(self.chunks, oldest, self.header_len, QUERY_RANK)
                self.cache.drop(start, start + oldest.tokens)
                self.vision.pop(oldest.index, None)
            self.tokens[oldest.owner] -= oldest.tokens
            self.chunks.pop(0)
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
        inv_freq = self.model.rope_inv_freq
        self.cache.map_keys(lambda k: rope_shift(k, -shift, inv_freq))
        for c in self.chunks:
            c.first_position -= shift
        self.max_position -= shift
        self.stats.shift += shift
        self.stats.rebases += 1

    # -- what an ask reads -------------------------------------------------------------------

    def kept_vision(self) -> torch.Tensor:
        """(video tokens, hidden * (1 + extra_levels)) the kept vision embeddings of every held
        chunk, in order, on every rank (a collective: each owner sends its chunks' device rows
        to every rank through :func:`comm.all_to_all_rows`; ``keep_vision``)."""
        model, rank, world = self.model, self.info.rank, self.info.world_size
        rows = [c.patches * self.tokens_per_patch for c in self.chunks]  # known on every rank
        width = model.text_config.hidden_size * (1 + model.extra_levels)
        owned = [self.vision[c.index] for c in self.chunks if c.owner == rank]
        mine = torch.cat(owned) if owned else torch.empty(0, width, dtype=model.dtype,
                                                           device=model.device)
        by_owner = [sum(n for n, c in zip(rows, self.chunks) if c.owner == r)
                    for r in range(world)]
        assert mine.shape == (by_owner[rank], width), (mine.shape, by_owner, width)
        received = comm.all_to_all_rows(mine.repeat(world, 1), [len(mine)] * world, by_owner,
                                        self.info.group)  # source-rank order
        at = [sum(by_owner[:r]) for r in range(world)]  # the next row of each source
        parts = []
        for n, c in zip(rows, self.chunks):
            parts.append(received[at[c.owner]:at[c.owner] + n])
            at[c.owner] += n
        return torch.cat(parts)

    def window_ids(self) -> torch.Tensor:
        """(N,) the context ids of the family's one-shot prompt on the held window's frames
        (a decoded-frame video of them at the stream's fps: Qwen3-VL's timestamps from 0)."""
        held = sum(c.patches for c in self.chunks)
        return self.model.prompt("?", (held, *self.grid_hw), sampling=self._sampling(held))[0]

    def close(self) -> None:
        """Free this rank's KV and kept embeddings (no collective)."""
        self.cache = RankKVCache(self.model.num_layers)
        self.vision.clear()
        self.chunks.clear()

