"""What a live stream (:mod:`apbv.engine.stream`) asks of a model family: the pieces of its
one-shot prompt as frames arrive, and their positions.

A stream's context is the family's one-shot context on the frames so far, cut in pieces:
:attr:`StreamPrompt.header` (the chat template before the first frame, prefilled at open),
one :meth:`StreamPrompt.chunk` per append (the chunk's frames: their video tokens and any
text of the family's around them, with their positions) and :attr:`StreamPrompt.after` (the
template's rest before the question, fed at an ask with the query ids). While nothing is
evicted, ``header + chunks + after`` is :meth:`apbv.model.adapter.VideoModel.prompt`'s
context on the same frames and the positions are :meth:`VideoModel.positions
<apbv.model.adapter.VideoModel.positions>`' (checked per family in the tests).

Implementations, one in each family's ``prompt.py``:
:class:`apbv.model.qwen2_5_vl.prompt.QwenStreamPrompt` (Qwen2.5-VL: one run of
``<|video_pad|>``, M-RoPE positions from the frames' timestamps),
:class:`apbv.model.internvl.prompt.InternVLStreamPrompt` (InternVL3: ``FrameN:
<img>...</img>`` per frame, 1-D positions),
:class:`apbv.model.qwen3_vl.prompt.Qwen3VLStreamPrompt` (Qwen3-VL: per temporal patch its
``<t seconds>`` and markers around its video tokens, interleaved M-RoPE positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from apbv.sequence import VIDEO_PAD, build_prompt


@dataclass(frozen=True)
class ChunkPlace:
    """Where a stream's new chunk goes (every rank computes it alike)."""

    first_frame: int
    """Frames fed before the chunk since the stream opened (evicted ones included)."""
    patches: Sequence[int]
    """Temporal unit index of each of the chunk's units, from their timestamps since the
    stream's first frame (:func:`apbv.engine.stream_plan.patch_indices`)."""
    seconds_per_patch: float
    """Seconds per temporal unit (frames per unit / the stream's fps)."""
    video_start: int
    """Position of the video's start: the header's length less the re-base shift."""
    next_position: int
    """One past the largest position fed so far (after the re-base shift)."""
    seconds: Sequence[float] = ()
    """Each unit's time: the mean of its first and last frame's capture times, in seconds
    since the stream's first frame, as the Qwen3-VL processor times a temporal patch (for a
    family that writes times into its prompt: Qwen3-VL's ``<t seconds>``)."""
    frames: Sequence[int] = ()
    """Each unit's first frame's number since the stream opened (evicted and pruned frames
    counted), for a family that numbers its frames (InternVL3's ``FrameN:``); empty: the
    units follow each other from ``first_frame`` (nothing pruned)."""


class StreamPrompt(Protocol):
    """A family's stream prompt (see the module docstring)."""

    header: torch.Tensor
    """(H,) int64: the context ids before the first frame."""
    after: torch.Tensor
    """(A,) int64: the context ids after the last frame (before the question)."""

    def chunk(self, place: ChunkPlace) -> tuple[torch.Tensor, torch.Tensor]:
        """(R,) int64 ids of the chunk's frames, with ``video_token_id`` where its video
        embeddings go in order, and their (3, 1, R) int64 positions."""


def split_at_video(processor: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(H,) and (A,) int64: the chat template's context ids before and after its video (the
    family's video ids stand between them, :func:`apbv.sequence.prompt_ids`)."""
    ids, _ = build_prompt(processor, "?", 1)
    cut = ids.tolist().index(processor.tokenizer.convert_tokens_to_ids(VIDEO_PAD))
    return ids[:cut], ids[cut + 1:]


def sequential_positions(start: int, rows: int) -> torch.Tensor:
    """(3, 1, rows) int64 1-D RoPE positions ``start .. start + rows - 1`` in three equal rows
    (the layout of :meth:`apbv.model.adapter.VideoModel.positions`)."""
    return torch.arange(start, start + rows).view(1, 1, -1).expand(3, 1, -1).clone()
