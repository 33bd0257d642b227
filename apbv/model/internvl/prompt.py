"""InternVL3's frame choice and prompt, from its processor alone (no weights): what the
engine's adapter (:mod:`apbv.model.internvl.adapter`) and the server's front end
(:func:`apbv.model.front.prompt_rules`) both use.

- Frames: the stock video processor's ``sample_frames`` rule (:func:`internvl_sampling`), one
  frame per temporal unit, kept at their native size (the stock processor resizes them to
  448x448 in the adapter).
- Prompt: the chat template's with ``<video>`` expanded as the stock processor does
  (``Frame1: <img>`` 256 x ``<IMG_CONTEXT>`` ``</img>``, frames joined by a new line), the
  question and system text tokenized as plain text (:func:`internvl_prompt_ids`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from apbv.model.stream_prompt import ChunkPlace, sequential_positions
from apbv.sequence import SYSTEM_SLOT, text_ids
from apbv.video import Sampling, VideoMeta, VideoSpec
from apbv.video.sampling import snapped

FAMILY = "InternVL3"
PATCH_SIZE = 14
"""InternViT's patch side in pixels (32 x 32 patches per 448x448 frame)."""
_QUESTION = "\u2063apbv-question\u2063"  # stands in for the question while rendering
DEFAULT_FPS = 2.0
"""Frames per second sampled when a request sets neither ``fps`` nor ``nframes`` (apbv's
default for every family; the stock processor then takes every frame)."""
_UNUSED = ("resized_height", "resized_width", "video_start", "video_end")
"""VideoSpec settings of Qwen2.5-VL's sampling that InternVL3's rule has no place for (refused;
the pixel budgets min/max/total_pixels are not used: every frame becomes one 448x448 tile)."""


def internvl_sampling(spec: VideoSpec, meta: VideoMeta, frame_size: tuple[int, int]) -> Sampling:
    """The frames InternVL3's stock video processor takes (``sample_frames`` with its initial
    shift): n frames at ``arange(total / n / 2, total, total / n)`` computed in float32 and
    truncated, n = ``spec.nframes``, else ``int(total / native fps * fps)`` (``spec.fps``,
    default :data:`DEFAULT_FPS`) capped by ``spec.max_frames``; one frame per temporal unit.
    The frames keep their native size here (the loader's resize is then the identity): the
    stock processor resizes them to ``frame_size`` (h, w) in :meth:`InternVL.process_frames`,
    as transformers does. ValueError naming the setting for a count beyond the file's frames
    or below one, and for Qwen2.5-VL's resize and clip settings (:data:`_UNUSED`)."""
    where = f"video {spec.path!r}"
    unused = [name for name in _UNUSED if getattr(spec, name) is not None]
    if unused:
        raise ValueError(f"{where}: {', '.join(unused)} are not used by {FAMILY} (every frame "
                         f"is resized to {frame_size[1]}x{frame_size[0]}); leave them unset")
    total = meta.total_frames
    if spec.nframes is not None:
        n, setting = spec.nframes, f"nframes={spec.nframes}"
    else:
        fps = DEFAULT_FPS if spec.fps is None else spec.fps
        n, setting = int(total / meta.fps * fps), f"fps={fps:g}"
        if spec.max_frames is not None:
            n = min(n, spec.max_frames)
    if not 1 <= n <= total:
        raise ValueError(f"{where}: {setting} gives {n} frames; {FAMILY} samples 1 .. {total} "
                         f"(the file's frames at {meta.fps:g} fps)")
    # The stock rule verbatim (Python floats, a float32 arange, truncation).
    indices = torch.arange(total / n / 2, total, total / n, dtype=torch.float32).int().tolist()
    indices, moved = snapped(indices, spec, meta, where)
    return Sampling(tuple(indices), len(indices) / total * meta.fps, meta.height, meta.width,
                    spec.image_patch_size, moved, temporal_patch_size=1)


def internvl_prompt_ids(processor: Any, question: str, num_frames: int,
                        system: str | None = None, kept: Sequence[int] | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Context ids (N,) and query ids (Q,) of the chat prompt over ``num_frames`` frames, as
    the stock processor builds them (``<video>`` -> ``Frame1: <img>`` ``image_seq_length`` x
    ``<IMG_CONTEXT>`` ``</img>``, frames joined by a new line); the question (and the
    ``system`` turn's text, when given) is tokenized apart as plain text
    (:func:`apbv.sequence.text_ids`), the query starts with the question. ``kept`` (temporal
    pruning): only those frames (0-based), each keeping its number ``Frame{i + 1}:``."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError("the question must be a non-empty string")
    tokenizer = processor.tokenizer
    context, query = _rendered(processor, system)
    frames = frames_text(tokenizer, 0, num_frames) if kept is None else \
        "\n".join(frame_text(tokenizer, i) for i in kept)
    head, _, rest = context.replace(tokenizer.video_token, frames).rpartition(SYSTEM_SLOT)
    ids = tokenizer(head, add_special_tokens=False)["input_ids"] if head else []
    if system is not None:
        ids += text_ids(tokenizer, system)
    ids += tokenizer(rest, add_special_tokens=False)["input_ids"]
    query_ids = text_ids(tokenizer, question) + \
        tokenizer(query, add_special_tokens=False)["input_ids"]
    return expand_frames(processor, ids), torch.tensor(query_ids, dtype=torch.long)


def _rendered(processor: Any, system: str | None) -> tuple[str, str]:
    """The chat template's text before and after the question (the context holds the one
    ``<video>``, and :data:`apbv.sequence.SYSTEM_SLOT` where the system text goes)."""
    tokenizer = processor.tokenizer
    messages: list[dict] = [{"role": "user", "content": [
        {"type": "video"}, {"type": "text", "text": _QUESTION}]}]
    if system is not None:
        messages.insert(0, {"role": "system",
                            "content": [{"type": "text", "text": SYSTEM_SLOT}]})
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    video = tokenizer.video_token
    if text.count(video) != 1 or text.count(_QUESTION) != 1 or \
            text.find(video) > text.find(_QUESTION) or (system is not None and (
                text.count(SYSTEM_SLOT) != 1 or text.find(SYSTEM_SLOT) > text.find(video))):
        raise ValueError(f"the chat template must place one {video} (after the system "
                         f"text, if any) before the question; it rendered {text!r}")
    context, query = text.split(_QUESTION)
    return context, query


def frames_text(tokenizer: Any, first: int, count: int) -> str:
    """The text of frames ``first + 1 .. first + count`` as the stock processor writes them
    (:func:`frame_text` joined by a new line)."""
    return "\n".join(frame_text(tokenizer, i) for i in range(first, first + count))


def frame_text(tokenizer: Any, frame: int) -> str:
    """Frame ``frame``'s (0-based) text, ``Frame{frame + 1}: <img><IMG_CONTEXT></img>`` (one
    ``<IMG_CONTEXT>``: :func:`expand_frames` repeats it)."""
    start, end = tokenizer.start_image_token, tokenizer.end_image_token
    return f"Frame{frame + 1}: {start}{tokenizer.context_image_token}{end}"


def expand_frames(processor: Any, ids: list[int]) -> torch.Tensor:
    """(N,) int64 ``ids`` with each ``<IMG_CONTEXT>`` repeated ``image_seq_length`` times (256:
    a frame's tokens after the pixel shuffle)."""
    context_id, per_frame = processor.tokenizer.context_image_token_id, \
        processor.image_seq_length
    return torch.tensor([t for i in ids for t in ([i] * per_frame if i == context_id else [i])],
                        dtype=torch.long)


@dataclass(frozen=True)
class InternVLRules:
    """InternVL3's frame choice, patch grid and prompt over its processor (the weight-free
    part of :class:`apbv.model.adapter.VideoModel`)."""

    processor: Any

    def plan_sampling(self, spec: VideoSpec, meta: VideoMeta) -> Sampling:
        """The stock processor's frame choice (:func:`internvl_sampling`)."""
        size = self.processor.video_processor.size
        return internvl_sampling(spec, meta, (size["height"], size["width"]))

    def video_grid(self, sampling: Sampling) -> tuple[int, int, int]:
        """(frames, h, w): the patch grid of the sampled frames once the processor has
        resized them (one frame per temporal unit; 32 x 32 for 448x448 frames)."""
        size = self.processor.video_processor.size
        return sampling.num_frames, size["height"] // PATCH_SIZE, size["width"] // PATCH_SIZE

    def prompt_ids(self, question: str, num_frames: int, system: str | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        return internvl_prompt_ids(self.processor, question, num_frames, system)

    def prompt(self, question: str, video_grid: tuple[int, int, int],
               system: str | None = None, *, sampling: Sampling | None = None,
               kept: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`internvl_prompt_ids` over the ``video_grid[0]`` frames of the grid (or its
        ``kept`` ones; ``sampling`` is not needed)."""
        return internvl_prompt_ids(self.processor, question, video_grid[0], system, kept)


@dataclass
class InternVLStreamPrompt:
    """InternVL3's live-stream prompt (:class:`apbv.model.stream_prompt.StreamPrompt`): the
    template's text before ``<video>`` (no system turn), per chunk its frames' text numbered on
    from the frames fed before it (:func:`frames_text`, a new line before every frame but the
    stream's first) at 1-D positions following everything fed, and the text after ``<video>``.
    Built from the same text as :func:`internvl_prompt_ids`, so the pieces join into its
    context ids (checked at construction: ValueError if the tokenizer merged them otherwise)."""

    processor: Any

    def __post_init__(self) -> None:
        tokenizer = self.processor.tokenizer
        before, _, after = _rendered(self.processor, None)[0].partition(tokenizer.video_token)
        self.header = self._ids(before)
        self.after = self._ids(after)
        place = ChunkPlace(0, (0,), 1.0, 0, 0)
        joined = torch.cat([self.header, self.chunk(place)[0],
                            self.chunk(dataclasses.replace(place, first_frame=1))[0], self.after])
        whole, _ = internvl_prompt_ids(self.processor, "?", 2)
        if not torch.equal(joined, whole):
            raise ValueError(f"{FAMILY}'s chat template does not tokenize frame by frame as a "
                             "whole: live streams cannot hold its prompt")

    def _ids(self, text: str) -> torch.Tensor:
        ids = self.processor.tokenizer(text, add_special_tokens=False)["input_ids"] if text \
            else []
        return expand_frames(self.processor, ids)

    def chunk(self, place: ChunkPlace) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's frames' ids (one frame per temporal unit, numbered by
        ``place.frames`` when given: temporal pruning) at 1-D positions from
        ``place.next_position``."""
        tokenizer = self.processor.tokenizer
        first = place.frames[0] if place.frames else place.first_frame
        text = "\n".join(frame_text(tokenizer, i) for i in place.frames) if place.frames \
            else frames_text(tokenizer, place.first_frame, len(place.patches))
        ids = self._ids(("\n" if first else "") + text)
        return ids, sequential_positions(place.next_position, len(ids))
