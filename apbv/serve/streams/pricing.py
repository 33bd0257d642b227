"""The time budget of a replica's live streams: a new stream or a new watch is refused (429,
with the figures) when the replica's streams would need more than its whole time.

A replica's load is seconds on its ranks per second of footage, summed over its open streams'
appends and their watches' evaluations
(:meth:`apbv.serve.streams.registry.StreamRegistry.time_share`).
Each figure is measured where it exists (a stream's last append, a watch's last evaluation) and
predicted otherwise, by the cost model (:func:`apbv.cost.stream.stream_seconds`) on the
server's ``--hardware`` preset, as deadline admission prices one-shot requests
(:class:`StreamPricing`).

How the two combine: the preset may be far from the machine (the tiny model on two CPU ranks
takes about 18x the ``cpu`` preset's prediction for ``benchmarks/results/stream_cpu.json``'s
appends, and 4-8x for ``watch_cpu.json``'s appends, 4-9x for its evaluations: the per-operation
dispatch and the transfer between ranks are not modelled), so each prediction is multiplied by
the replica's measured / predicted append seconds, summed over its streams with a measured
append (:func:`combined_load`; 1.0 before any was measured): a new stream's load, a stream not
yet appended to, a watch not yet evaluated (one scale for appends and asks, which those runs
find off by alike factors). A measured figure
replaces its own prediction; a stream the server could not price counts its measured load
alone (0 before its first append).

With temporal pruning (``static_threshold``) a stream's appends cost what changes: its measured
load is the mean over its last :data:`RECENT_APPENDS` appends (:class:`RecentAppends`: one
append keeping a patch costs a full chunk, the next none), and its prediction takes its keep
rate measured over them (kept / appended temporal patches; a new stream: 1, every patch), so
a static camera's figures are what it takes and the replica admits more of them. Only streams
that keep at least :data:`SCALE_KEEP_RATE` of their patches set the scale (a mostly pruned
append's seconds are the per-append dispatch the model leaves out, not its prediction's
compute).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from apbv.cost.hardware import Hardware
from apbv.cost.stream import StreamCost, stream_seconds
from apbv.cost.work import ModelDims
from apbv.engine.stream_plan import Appended, StreamSpec
from apbv.openai.policy import ClientError
from apbv.serve.streams.budget import KVSizing

RECENT_APPENDS = 16
"""Appends a stream's measured load and keep rate are taken over (its most recent)."""
MIN_KEEP_RATE = 0.05
"""The least keep rate a stream is priced at (one patch in 20: a static camera still keeps a
patch when something moves)."""
SCALE_KEEP_RATE = 0.5
"""Streams keeping at least this share of their patches set the prediction scale."""


@dataclass
class RecentAppends:
    """A stream's last :data:`RECENT_APPENDS` appends (``rows``: temporal patches appended,
    kept, seconds on the ranks, seconds of footage) and the tokens its chunks added since it
    opened (``tokens``: a watch whose stream gained none since its last evaluation reuses that
    evaluation's answer)."""

    rows: deque[tuple[int, int, float, float]] = field(
        default_factory=lambda: deque(maxlen=RECENT_APPENDS))
    tokens: int = 0
    appends: int = 0

    def add(self, appended: Appended, seconds: float, footage_s: float) -> float:
        """Record an append (what the engine did, its seconds on the ranks, the footage
        seconds it brought); returns :attr:`load`. The stream's first append (its first patch
        is always kept: a start-up cost, not its steady load) stands for it only until a
        second one is measured."""
        if self.appends == 1 and len(self.rows) == 1:
            self.rows.clear()
        self.rows.append((appended.patches, appended.kept, seconds, footage_s))
        self.tokens += appended.tokens
        self.appends += 1
        return self.load or 0.0

    @property
    def keep_rate(self) -> float | None:
        """Kept / appended temporal patches over the recent appends (None: none appended)."""
        patches = sum(r[0] for r in self.rows)
        return sum(r[1] for r in self.rows) / patches if patches else None

    @property
    def load(self) -> float | None:
        """Seconds on the ranks per second of footage over the recent appends (None: none)."""
        footage = sum(r[3] for r in self.rows)
        return sum(r[2] for r in self.rows) / footage if footage > 0 else None

    @property
    def priced(self) -> float:
        """The keep rate the stream is priced at (:func:`priced_keep_rate`)."""
        return priced_keep_rate(self.keep_rate)

    @property
    def mostly_pruned(self) -> bool:
        """Whether it keeps less than :data:`SCALE_KEEP_RATE` of its patches (its measured
        load does not set the prediction scale)."""
        rate = self.keep_rate
        return rate is not None and rate < SCALE_KEEP_RATE


def priced_keep_rate(measured: float | None) -> float:
    """The keep rate a stream is priced at: its measured one (:class:`RecentAppends`), at least
    :data:`MIN_KEEP_RATE`; 1 before one was measured."""
    return 1.0 if measured is None else max(MIN_KEEP_RATE, min(1.0, measured))


@dataclass(frozen=True)
class StreamPricing:
    """What the server prices its streams with: the checkpoint's sizes, the hardware preset,
    the ranks of one replica, frames per append (before one was measured: the largest push,
    ``--max-frames-per-push``, as a capture's feeder takes them) and the tokenizer's count of a
    text's tokens."""

    dims: ModelDims
    hw: Hardware
    world_size: int
    chunk_frames: int
    count_tokens: Callable[[str], int]

    def cost(self, sizing: KVSizing, spec: StreamSpec, pixels: int, question: str = "",
             choices: Sequence[str] = (), keep_rate: float = 1.0) -> StreamCost:
        """A stream of ``spec`` whose frames have ``pixels`` pixels, its window as the memory
        budget counts it (:meth:`KVSizing.tokens_per_rank`: without one, the engine's ceiling),
        keeping ``keep_rate`` of its temporal patches, and an ask of ``question`` with
        ``choices`` on it."""
        tokens = sizing.unit_tokens(pixels)
        held = sizing.tokens_per_rank(tokens, spec.fps, spec.window_s, spec.window_tokens)
        return stream_seconds(
            self.dims, self.hw, frame_tokens=tokens, fps=spec.fps, held_tokens=held,
            world_size=self.world_size, chunk_frames=self.chunk_frames,
            question_tokens=self.count_tokens(question) if question else 0,
            choice_tokens=tuple(self.count_tokens(c) for c in choices), keep_rate=keep_rate)


class TextTokenizer(Protocol):
    """A transformers tokenizer, as far as pricing counts a text's tokens with it."""

    def __call__(self, text: str, *, add_special_tokens: bool) -> Mapping[str, list[int]]: ...


def server_pricing(model_path: str, world_size: int, hardware: str, chunk_frames: int,
                   tokenizer: TextTokenizer) -> StreamPricing:
    """:class:`StreamPricing` of the checkpoint at ``model_path`` on a hardware preset (or
    calibration file) ``hardware``, counting tokens with ``tokenizer`` (a transformers one)."""
    from apbv import cost

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    return StreamPricing(cost.checkpoint_dims(model_path), cost.hardware(hardware), world_size,
                         chunk_frames, count)


def combined_load(streams: Iterable[tuple[float | None, float | None]]) -> tuple[float, float]:
    """(seconds per second of footage, the scale on predictions) of streams' appends, each
    given as (its measured load or None, its predicted load or None): the measured figure where
    there is one, else the prediction x the scale, the ratio of measured to predicted loads
    summed over the streams that have both (1.0 where none has; a mostly pruned stream is
    given without its prediction, see the module docstring)."""
    figures = list(streams)
    both = [(m, p) for m, p in figures if m is not None and p]
    scale = sum(m for m, _ in both) / sum(p for _, p in both) if both else 1.0
    load = sum(m if m is not None else scale * (p or 0.0) for m, p in figures)
    return load, scale


def check_stream(replica: int, held: float, need: StreamCost, scale: float, spec: StreamSpec,
                 pixels: int) -> None:
    """ClientError 429 when a new stream whose appends take ``need``'s load x ``scale`` would
    bring replica ``replica``, whose streams take ``held`` of its time, past all of it."""
    load = need.append_load * scale
    if held + load <= 1.0:
        return
    scaled = "" if scale == 1.0 else f" (the cost model's {need.append_load:.3f} x {scale:.2f}, " \
                                     "its streams' measured / predicted appends)"
    window = "none" if not spec.windowed else \
        ", ".join(f"{k} {v:g}" for k, v in (("window_s", spec.window_s),
                                            ("window_tokens", spec.window_tokens)) if v)
    raise ClientError(429, f"replica {replica} cannot sustain this stream: its appends need "
                           f"about {load:.3f} s per second of footage{scaled} ({load:.0%} of "
                           f"the replica) at {spec.fps:g} fps, {pixels} pixels per frame and "
                           f"window {window}, and the streams there already take {held:.0%} "
                           "(appends and watches, measured where they were, predicted "
                           "otherwise); lower fps, the frame size (max_pixels, width/height) "
                           "or the window (window_s, window_tokens), or close a stream")
