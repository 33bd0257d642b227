"""Qwen3-VL's frame choice, pixel budget and prompt, from its processor alone (no weights): what
the engine's adapter (:mod:`apbv.model.qwen3_vl.adapter`) and the server's front end
(:func:`apbv.model.front.prompt_rules`) both use.

- Frames (:func:`qwen3_vl_sampling`): the stock video processor's ``sample_frames``: with a
  frame count n, ``linspace(0, total - 1, n).round()``; else ``int(total / native fps *
  fps)`` frames (``fps`` default: the processor's, 2) clamped to the processor's
  ``min_frames`` .. ``max_frames`` (or ``VideoSpec.max_frames``) and the file's frames, not
  rounded to even; an odd count is padded with the last frame, as the processor pads.
- Size: the stock ``smart_resize`` with the processor's ``size`` as a budget for the whole clip
  (frames x height x width), in multiples of patch x merge (32) pixels.
- Prompt (:func:`qwen3_vl_prompt_ids`): the chat template's with ``<|video_pad|>`` expanded as
  the stock processor does, per temporal patch ``<{t:.1f} seconds>`` ``<|vision_start|>``
  tokens ``<|vision_end|>``, inside the template's own ``<|vision_start|>`` ...
  ``<|vision_end|>``; t is the mean time of the patch's two frames, frame index / the file's
  fps (the processor's ``_calculate_timestamps``), so 29.97 and 30 fps give different text.
- Live streams (:class:`Qwen3VLStreamPrompt`): the same ids chunk by chunk, t the mean capture
  time of the patch's two frames since the stream's first frame.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from apbv.model.stream_prompt import ChunkPlace, sequential_positions, split_at_video
from apbv.positions import video_positions
from apbv.sequence import prompt_ids, split_prompt
from apbv.video import Sampling, VideoMeta, VideoSpec
from apbv.video.prune import pruned_grid
from apbv.video.sampling import snapped

FAMILY = "Qwen3-VL"
_UNUSED = ("resized_height", "resized_width", "video_start", "video_end")
"""VideoSpec settings of Qwen2.5-VL's sampling (qwen-vl-utils) that Qwen3-VL's stock rule has
no place for: refused. The per-frame budgets ``min_pixels``/``max_pixels``/``total_pixels``
are not used (as for InternVL3): the budget is the processor's ``size`` for the whole clip."""


def _smart_resize() -> Any:
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    return smart_resize


def qwen3_vl_sampling(spec: VideoSpec, meta: VideoMeta, video_processor: Any) -> Sampling:
    """The frames and size Qwen3-VL's stock video processor gives (see the module docstring),
    from the file's ``meta``; ValueError naming the setting for a count outside 2 .. the
    file's frames and for Qwen2.5-VL's resize and clip settings (:data:`_UNUSED`)."""
    vp = video_processor
    where = f"video {spec.path!r}"
    unused = [name for name in _UNUSED if getattr(spec, name) is not None]
    if unused:
        raise ValueError(f"{where}: {', '.join(unused)} are not used by {FAMILY} (its frames "
                         f"span the whole file, sized by the processor's pixel budget for the "
                         f"whole clip); leave them unset")
    total = meta.total_frames
    if spec.nframes is not None:
        n, setting = spec.nframes, f"nframes={spec.nframes}"
    else:
        fps = vp.fps if spec.fps is None else spec.fps
        setting = f"fps={fps:g}"
        n = int(total / meta.fps * fps)
        n = min(max(n, vp.min_frames), spec.max_frames or vp.max_frames, total)
    tps = vp.temporal_patch_size
    if not tps <= n <= total:
        raise ValueError(f"{where}: {setting} gives {n} frames; {FAMILY} samples {tps} .. "
                         f"{total} (the file's frames at {meta.fps:g} fps)")
    # The stock rule verbatim (numpy's float64 linspace, rounded half to even).
    indices = [int(i) for i in np.linspace(0, total - 1, n).round().astype(int)]
    size = vp.size
    max_pixels = size["longest_edge"]
    if getattr(vp, "cap_pixels_per_frame", None):  # the processor's per-frame cap, when on
        factor = vp.patch_size * vp.merge_size
        per_frame = max(min(vp.max_video_tokens * factor * factor, max_pixels // n),
                        int(size["shortest_edge"] * 1.05))
        max_pixels = per_frame * n
    height, width = _smart_resize()(n, meta.height, meta.width, temporal_factor=tps,
                                    factor=vp.patch_size * vp.merge_size,
                                    min_pixels=size["shortest_edge"], max_pixels=max_pixels)
    indices, moved = snapped(indices, spec, meta, where)
    indices += indices[-1:] * (-len(indices) % tps)  # the processor pads with the last frame
    return Sampling(tuple(indices), n / total * meta.fps, height, width, vp.patch_size, moved,
                    temporal_patch_size=tps, video_fps=meta.fps, processor_resize=True)


def timestamps(processor: Any, sampling: Sampling) -> list[float]:
    """Seconds of each temporal patch of ``sampling`` as the stock processor computes them
    (``_calculate_timestamps``: the mean of the patch's first and last frame's index / the
    file's fps)."""
    if sampling.video_fps is None:
        raise ValueError(f"{FAMILY} prompts need the video's frame rate for their timestamps")
    return processor._calculate_timestamps(list(sampling.indices), sampling.video_fps,
                                           processor.video_processor.temporal_patch_size)


def qwen3_vl_prompt_ids(processor: Any, question: str, video_grid: tuple[int, int, int],
                        seconds: list[float], system: str | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Context ids (N,) and query ids (Q,) over a video of patch grid ``video_grid`` (t, h, w)
    whose temporal patches sit at ``seconds`` (t values), as the stock processor expands the
    chat template's video (the module docstring); the question and system text are plain text
    (:func:`apbv.sequence.prompt_ids`)."""
    t, h, w = video_grid
    if len(seconds) != t:
        raise ValueError(f"{len(seconds)} timestamps for {t} temporal patches")
    context_text, query_text = split_prompt(processor, question, system)
    merge = processor.video_processor.merge_size
    video_ids = [i for part in patch_ids(processor, (h // merge) * (w // merge), seconds)
                 for i in part[0] + part[1]]
    return prompt_ids(processor.tokenizer, context_text, query_text, question, 0, system,
                      video_ids=video_ids)


def patch_ids(processor: Any, tokens: int, seconds: Sequence[float],
              ) -> list[tuple[list[int], list[int]]]:
    """Per temporal patch at ``seconds`` (t values), its text ids (``<{t:.1f} seconds>`` and
    ``<|vision_start|>``) and its vision ids (``tokens`` ``<|video_pad|>`` and
    ``<|vision_end|>``), as the stock processor expands a video (the stamp tokenized alone)."""
    stamp_ids: dict[str, list[int]] = {}
    vision = [processor.video_token_id] * tokens + [processor.vision_end_token_id]
    parts = []
    for second in seconds:
        text = f"<{second:.1f} seconds>"
        if text not in stamp_ids:
            stamp_ids[text] = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        parts.append((stamp_ids[text] + [processor.vision_start_token_id], vision))
    return parts


@dataclass(frozen=True)
class Qwen3VLRules:
    """Qwen3-VL's frame choice, patch grid and prompt over its processor (the weight-free part
    of :class:`apbv.model.adapter.VideoModel`)."""

    processor: Any

    def __post_init__(self) -> None:
        from apbv.model.common.hf_compat import check_qwen3_vl_version

        check_qwen3_vl_version()

    def plan_sampling(self, spec: VideoSpec, meta: VideoMeta) -> Sampling:
        return qwen3_vl_sampling(spec, meta, self.processor.video_processor)

    def video_grid(self, sampling: Sampling) -> tuple[int, int, int]:
        """The processor's ``video_grid_thw`` of the sampled, resized frames (in its own
        patches, whatever ``sampling.image_patch_size`` says: e.g. a stream's frames)."""
        patch = self.processor.video_processor.patch_size
        return sampling.num_patches, sampling.resized_height // patch, \
            sampling.resized_width // patch

    def prompt(self, question: str, video_grid: tuple[int, int, int],
               system: str | None = None, *, sampling: Sampling | None = None,
               kept: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`qwen3_vl_prompt_ids` with the timestamps of ``sampling`` (required: they
        are part of the prompt); with ``kept`` (temporal pruning) only those temporal patches,
        each with its own ``<t seconds>`` text: a dropped patch's text goes with its tokens."""
        if sampling is None:
            raise ValueError(f"{FAMILY} prompts need the sampling (frame indices and fps) for "
                             "their timestamps")
        seconds = timestamps(self.processor, sampling)
        if kept is not None:
            seconds = [seconds[g] for g in kept]
        return qwen3_vl_prompt_ids(self.processor, question, pruned_grid(video_grid, kept),
                                   seconds, system)


@dataclass
class Qwen3VLStreamPrompt:
    """Qwen3-VL's live-stream prompt (:class:`apbv.model.stream_prompt.StreamPrompt`): the
    template's ids before and after its video (the template's own ``<|vision_start|>`` and
    ``<|vision_end|>`` included), and per chunk each temporal patch's ``<t seconds>``, markers
    and video tokens (:func:`patch_ids`, t: the unit's time ``ChunkPlace.seconds``) at the
    stock interleaved M-RoPE positions: text 1-D on from ``next_position``, a patch's tokens a
    one-frame grid at the position after its text (rows and columns of the merged ``merged_hw``
    (gh, gw) grid added to it), the text after it at that position + max(gh, gw)."""

    processor: Any
    merged_hw: tuple[int, int]

    def __post_init__(self) -> None:
        from apbv.model.common.hf_compat import check_qwen3_vl_version

        check_qwen3_vl_version()
        self.header, self.after = split_at_video(self.processor)

    def chunk(self, place: ChunkPlace) -> tuple[torch.Tensor, torch.Tensor]:
        assert len(place.seconds) == len(place.patches), (place.seconds, place.patches)
        gh, gw = self.merged_hw
        ids: list[int] = []
        positions = []
        at = place.next_position
        for text, vision in patch_ids(self.processor, gh * gw, place.seconds):
            positions.append(sequential_positions(at, len(text))[:, 0])
            at += len(text)
            positions.append(video_positions([0], gh, gw, 0.0, 0.0, at))
            at += max(gh, gw)
            positions.append(sequential_positions(at, 1)[:, 0])  # <|vision_end|>
            at += 1
            ids += text + vision
        return torch.tensor(ids, dtype=torch.long), torch.cat(positions, dim=-1).unsqueeze(1)
