"""Predicted time of a live stream on its replica (:func:`stream_seconds`): the appends' seconds
per second of footage and one ask's seconds, for admitting a stream or a standing question
against the replica's time.

An append of ``chunk_frames`` frames runs the chunk's temporal units through the vision tower
(:func:`apbv.cost.schedule.vision_cost`) and prefills the chunk's tokens against the held
window on the rank that owns the chunk: every layer's linears on the chunk's rows, its attention
over the held keys of every rank and causally within the chunk, the elementwise passes as
:func:`apbv.cost.schedule.full_layer` counts them. An ask prefills the question and the
choices (one pass, scored together) against the held window the same way, and the lm_head on
each choice's rows. Frame decoding is not priced (a stream's frames arrive decoded).

With temporal pruning a stream keeps ``keep_rate`` of its temporal units (measured per stream
from its recent chunks, :class:`apbv.serve.stream_time.RecentAppends`): the tower runs on the
kept units only and an append prefills their tokens only, so the appends' seconds scale with it
(the held window is priced whole: a conservative bound).
"""

from __future__ import annotations

from dataclasses import dataclass

from apbv.cost.hardware import Hardware, Machine
from apbv.cost.schedule import vision_cost
from apbv.cost.work import ModelDims, squarest_grid


@dataclass(frozen=True)
class StreamCost:
    """Seconds on the replica's ranks of one stream's appends and of one ask on it."""

    vision_s: float
    """Vision tower seconds per second of footage."""
    prefill_s: float
    """The chunks' prefill against the held window, seconds per second of footage."""
    ask_s: float
    """One ask (question and choices) against the held window, seconds."""

    @property
    def append_load(self) -> float:
        """Seconds of appends per second of footage: the share of the replica they take."""
        return self.vision_s + self.prefill_s


def _prefill_s(dims: ModelDims, m: Machine, rows: int, held: int) -> float:
    """Seconds of ``rows`` new tokens through every layer against ``held`` cached keys."""
    if rows == 0:
        return 0.0
    d, kv, hq = dims.head_dim, dims.kv_heads, dims.heads
    pairs = rows * held + rows * (rows + 1) // 2
    elementwise = 10 * dims.hidden + 3 * dims.intermediate + 10 * (hq + kv) * d + 4 * kv * d
    layer = (m.matmuls(rows, dims.text_linears()) + m.mem(m.dtype * rows * elementwise)
             + m.attention(pairs, hq, d))
    return dims.layers * m.host(layer, m.hw.layer_overhead_s)


def stream_seconds(dims: ModelDims, hw: Hardware, *, frame_tokens: int, fps: float,
                   held_tokens: int, world_size: int, chunk_frames: int,
                   question_tokens: int, choice_tokens: tuple[int, ...] = (),
                   keep_rate: float = 1.0) -> StreamCost:
    """Predicted seconds of a stream sampled at ``fps`` frames per second of footage whose
    temporal units (``dims.temporal_patch_size`` frames) add ``frame_tokens`` LLM tokens each,
    appended ``chunk_frames`` frames at a time, keeping ``held_tokens`` tokens per rank on
    ``world_size`` ranks (the window, or what the memory budget holds), on ``hw``; an ask of
    ``question_tokens`` tokens with one choice of each of ``choice_tokens`` tokens (none: a
    free answer's first token); ``keep_rate``: the share of temporal units kept by temporal
    pruning (1: all; an append keeps ``keep_rate`` x its units on average).

    ValueError for a non-positive ``fps`` or ``chunk_frames``, negative token counts or a
    ``keep_rate`` outside (0, 1].
    """
    if not fps > 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    if chunk_frames < 1:
        raise ValueError(f"chunk_frames must be >= 1, got {chunk_frames}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 < keep_rate <= 1:
        raise ValueError(f"keep_rate must be in (0, 1] (the share of temporal patches kept), "
                         f"got {keep_rate}")
    counts = {"frame_tokens": frame_tokens, "held_tokens": held_tokens,
              "question_tokens": question_tokens, "choice_tokens": min(choice_tokens, default=0)}
    for name, value in counts.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    m = Machine(hw, hw.dtype_bytes)
    units = max(1, chunk_frames // dims.temporal_patch_size)
    chunk_s = chunk_frames / fps  # footage seconds one append brings
    kept = units * keep_rate  # units kept per append, on average
    held = held_tokens * world_size  # every rank's keys attend
    whole = max(1, round(kept))  # an append that keeps any keeps whole units
    vision, _ = vision_cost(dims, whole, squarest_grid(frame_tokens), m)
    prefill = _prefill_s(dims, m, whole * frame_tokens, held)
    vision, prefill = vision * kept / whole, prefill * kept / whole
    answer = question_tokens + sum(choice_tokens)
    heads = max(1, len(choice_tokens)) * m.matmuls(1, [(dims.hidden, dims.vocab)])
    ask = _prefill_s(dims, m, answer, held) + heads
    return StreamCost(vision_s=vision / chunk_s, prefill_s=prefill / chunk_s, ask_s=ask)
