"""What a live stream is, before any rank holds it, and its chunk bookkeeping: pure arithmetic
every rank does alike, with no tensor and no collective (tested for all ranks in one process,
as :mod:`apbv.plan` is).

- :class:`StreamSpec` (frame size, sampling rate, window), :class:`Chunk`, the stats;
- :func:`check_timestamps`: the rule pushed frames follow (checked by the server and by the
  engine on every rank alike);
- :func:`pick_owner`: the rank a new chunk goes to; :func:`row_start`: where a chunk's rows
  start in its owner's cache; :func:`evictions`: how many of the oldest chunks the window
  drops; :func:`patch_indices`: the temporal patch index of each new patch;
  :func:`check_room`: whether a chunk still fits the model's context.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from apbv.validate import check_int, positive, pruning_settings

MAX_TIMESTAMP_S = 1e10
"""A frame's timestamp is within +-this many seconds (Unix times fit, and float seconds there
still tell microseconds apart)."""

MAX_TIMESTAMP_GAP_S = 3600.0
"""The most a frame's timestamp may pass the previous frame's, in seconds (a pause: its
positions are taken from the model's context; after a longer one, open a new stream)."""


def check_timestamps(stamps: Sequence[Any], last: float | None) -> list[float]:
    """``stamps`` (seconds, one per frame) as floats, or ValueError naming the bound broken:
    each a finite number within +-``MAX_TIMESTAMP_S``, greater than the one before it (the
    first: than ``last``, the stream's newest; None before its first frame) by at most
    ``MAX_TIMESTAMP_GAP_S``."""
    out: list[float] = []
    previous = last
    for item in stamps:
        try:
            t = float(item) if not isinstance(item, (bool, str, bytes)) else math.nan
        except (TypeError, ValueError):
            t = math.nan
        if not math.isfinite(t):
            raise ValueError(f"timestamps must be finite numbers of seconds, got {item!r}")
        if abs(t) > MAX_TIMESTAMP_S:
            raise ValueError(f"timestamps must be within +-{MAX_TIMESTAMP_S:g} s, got {t:g}")
        if previous is not None and t <= previous:
            raise ValueError(f"timestamps must increase: {t!r} follows {previous!r}")
        if previous is not None and t - previous > MAX_TIMESTAMP_GAP_S:
            raise ValueError(f"timestamps may jump at most {MAX_TIMESTAMP_GAP_S:g} s from the "
                             f"previous frame: {t!r} follows {previous!r}, {t - previous:g} s "
                             "later (after a longer pause, open a new stream)")
        out.append(t)
        previous = t
    return out


@dataclass(frozen=True)
class StreamSpec:
    """How a stream samples and keeps its video (fixed at open)."""

    height: int
    """Frame height after resizing (a multiple of the family's
    :attr:`~apbv.model.adapter.VideoModel.frame_multiple`, checked at open: 28 for Qwen2.5-VL,
    see apbv.video.sampling.stream_frame_size; 32 for Qwen3-VL)."""
    width: int
    """Frame width after resizing (a multiple of the family's, as ``height``)."""
    fps: float = 2.0
    """Frames per second the stream is sampled at (a temporal unit of the family's frames
    spans frames / fps seconds: Qwen2.5-VL's M-RoPE time step is 2 / fps)."""
    window_s: float | None = None
    """Keep the chunks of the last ``window_s`` seconds of video (None: no time window)."""
    window_tokens: int | None = None
    """Keep at most this many video tokens per rank on average (None: no token budget)."""
    keep_vision: bool = False
    """Keep each chunk's vision embeddings (on its owner) so ``ask(fresh=True)`` can run."""
    rebase_at: int | None = None
    """Re-base the positions before they pass this (None: half the model's context)."""
    static_threshold: float | None = None
    """Temporal pruning of appended chunks (levels 0-255, 0: off; None: the config's
    ``video.static_threshold``): a temporal patch that changed less than this since the
    stream's last kept patch is not encoded and adds no tokens (:mod:`apbv.video.prune`)."""

    def __post_init__(self) -> None:
        for name in ("height", "width"):
            check_int(name, getattr(self, name), 1)
        object.__setattr__(self, "fps", positive("fps", self.fps))
        object.__setattr__(self, "window_s", positive("window_s", self.window_s, allow_none=True))
        if self.window_tokens is not None:
            check_int("window_tokens", self.window_tokens, 1)
        if self.rebase_at is not None:
            check_int("rebase_at", self.rebase_at, 1)
        if self.static_threshold is not None:
            pruning_settings(0.0, self.static_threshold,
                             names=("pruning_rate", "static_threshold"))

    @property
    def windowed(self) -> bool:
        return self.window_s is not None or self.window_tokens is not None


@dataclass
class Chunk:
    """One append's whole temporal patches, as every rank records it."""

    index: int
    owner: int
    first_patch: int
    """Temporal patch index (since the stream's first frame) of its first patch."""
    patches: int
    tokens: int
    start_s: float
    """Timestamp of its first frame."""
    end_s: float
    """Timestamp of its last frame."""
    first_position: int
    """Temporal position of its first token (after any re-basing)."""


@dataclass
class StreamStats:
    frames: int = 0
    """Frames appended (the buffered odd frame included)."""
    chunks: int = 0
    evicted_chunks: int = 0
    rebases: int = 0
    shift: int = 0
    """Positions taken off every cached position by re-basing so far."""
    patches_pruned: int = 0
    """Temporal patches appended and dropped as unchanged (temporal pruning)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Per stage, summed over appends (slowest rank per append)."""


@dataclass(frozen=True)
class Appended:
    """What one :meth:`apbv.engine.engine.Engine.append` did (identical on every rank)."""

    chunk: int | None
    """The new chunk's index; None when no whole temporal patch was complete."""
    owner: int | None
    """The rank that keeps its KV (None: no chunk)."""
    tokens: int
    """Its video tokens."""
    evicted: int
    """Chunks the window dropped after it."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Per stage (vision, transfer, prefill), the slowest rank."""
    patches: int = 0
    """Whole temporal patches this append completed (pruned ones included)."""
    kept: int = 0
    """Of those, the ones kept (all of them without temporal pruning): the chunk's."""


@dataclass(frozen=True)
class StreamInfo:
    """A stream's state for clients (:meth:`apbv.engine.engine.Engine.describe_stream`;
    identical on every rank)."""

    frames_appended: int
    frames_held: int
    chunks_held: int
    chunks_evicted: int
    seconds_held: float
    """From the first held frame to one frame past the newest (0 when nothing is held)."""
    video_tokens_per_rank: list[int]
    tokens_per_rank: list[int]
    """Every token each rank holds (the chat template's header on the query rank too)."""
    rebases: int
    position_shift: int
    seconds: dict[str, float]
    """Per stage, summed over appends (slowest rank per append)."""
    patches_pruned: int = 0
    """Temporal patches dropped as unchanged since the stream opened (temporal pruning)."""
    static_threshold: float = 0.0
    """The temporal pruning threshold in effect (levels; 0: off): the spec's, else the
    config's."""
    pruning_grid: tuple[int, int, int] = (1, 1, 1)
    """(frames per temporal patch, gh, gw): the units and merged-patch cells a patch's
    signature is taken over (:class:`apbv.engine.stream_prune.ChunkPruner`)."""


def pick_owner(tokens: Sequence[int]) -> int:
    """The rank a new chunk goes to: the one holding the fewest ``tokens`` (per rank; ties
    to the lowest rank), so memory stays balanced."""
    return min(range(len(tokens)), key=lambda r: (tokens[r], r))


def row_start(chunks: Sequence[Chunk], chunk: Chunk, header_len: int, query_rank: int) -> int:
    """Where ``chunk``'s rows start in its owner's cache: after the header (on
    ``query_rank``, which holds it) and the held ``chunks`` before it with the same owner."""
    start = header_len if chunk.owner == query_rank else 0
    for c in chunks:
        if c is chunk:
            return start
        if c.owner == chunk.owner:
            start += c.tokens
    raise AssertionError(f"chunk {chunk.index} is not held")


def evictions(chunks: Sequence[Chunk], spec: StreamSpec, world_size: int) -> int:
    """How many of the oldest ``chunks`` the window drops (the newest always stays): while
    the newest ends ``window_s`` or more after the oldest's end, or the video tokens pass
    ``window_tokens`` per rank on average."""
    video, n = sum(c.tokens for c in chunks), 0
    while len(chunks) - n > 1:
        oldest, newest = chunks[n], chunks[-1]
        too_old = spec.window_s is not None and newest.end_s - oldest.end_s >= spec.window_s
        too_many = spec.window_tokens is not None and video > spec.window_tokens * world_size
        if not (too_old or too_many):
            break
        video -= oldest.tokens
        n += 1
    return n


def patch_indices(starts: Sequence[float], t0: float, seconds_per_patch: float,
                  next_patch: int) -> list[int]:
    """Temporal patch index of each new patch (first-frame timestamps ``starts``, seconds):
    its time since the stream's first frame ``t0`` in patches, rounded, and always after the
    previous patch (the first: at least ``next_patch``)."""
    out, prev = [], next_patch - 1
    for t in starts:
        g = max(round((t - t0) / seconds_per_patch), prev + 1)
        out.append(g)
        prev = g
    return out


def unit_times(stamps: Sequence[float], t0: float, unit: int) -> list[float]:
    """Time of each temporal unit of ``unit`` frames with capture times ``stamps`` (seconds):
    the mean of its first and last frame's times since the stream's first frame ``t0``, as
    the Qwen3-VL processor times a temporal patch (``_calculate_timestamps``)."""
    since = [t - t0 for t in stamps]
    return [(since[i] + since[i + unit - 1]) / 2 for i in range(0, len(since), unit)]


def check_room(held: int, tokens: int, limit: int) -> None:
    """ValueError when a chunk of ``tokens`` on top of the ``held`` tokens would pass the
    model's context of ``limit`` tokens."""
    if held + tokens > limit:
        raise ValueError(
            f"the stream holds {held} tokens and a chunk of {tokens} would pass the "
            f"model's context of {limit}: open the stream with a window (window_s or "
            f"window_tokens)")
