"""The InternVL3 adapter (``model_type`` internvl): stock HF InternVL driven by apbv.

InternVL3 as the paper runs it: every frame resized to the checkpoint's image size (448x448)
as one tile, normalised with the checkpoint's mean and std, by the stock video processor; the
vision tower (InternViT) runs per frame, so a rank's share is whole frames and the
concatenation of the shares equals the tower on the whole video; a pixel shuffle at ratio 0.5
(:attr:`InternVL.spatial_merge_size` 2 over the 32x32 patch grid) and the projector give 256
tokens per frame. The prompt is the chat template's with ``<video>`` expanded as the stock
processor does (``Frame1: <img>`` 256 x ``<IMG_CONTEXT>`` ``</img>``, frames joined by a new
line): :meth:`InternVL.prompt_ids`. Positions are plain 1-D RoPE (three equal rows in the
(3, 1, T) layout of :class:`apbv.model.adapter.VideoModel`). The decoder's attention goes
through :mod:`apbv.model.common.hook`.

Frames are chosen by the stock video processor's rule
(:func:`apbv.model.internvl.prompt.internvl_sampling`) at their native size and resized to the
checkpoint's image size by the stock processor here; the temporal unit is one frame. The
video tokens are one run per frame with text between the frames
(:meth:`InternVL.video_runs`); the engine routes the k-th embedding to the k-th
``<IMG_CONTEXT>`` token (:class:`apbv.ownership.VideoSpan`).
Live streams hold the same prompt frame by frame (:class:`apbv.model.internvl.prompt.
InternVLStreamPrompt`: each chunk's ``FrameN`` text numbered on from the frames fed before it);
decoded-frame requests take every frame as its own temporal unit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import InternVLForConditionalGeneration

from apbv.model.common.hf_compat import tower_output
from apbv.model.common.hf_decoder import HFVisionLM, load_stock
from apbv.model.internvl.prompt import FAMILY, InternVLRules, InternVLStreamPrompt
from apbv.model.stream_prompt import sequential_positions
from apbv.video import Sampling, VideoMeta, VideoSpec
from apbv.video.patches import PIPELINE_CHUNK_ROWS

if TYPE_CHECKING:
    from apbv.config import VisionConfig
    from apbv.model.adapter import VideoFeatures

MODEL_TYPE = "internvl"
TEXT_MODEL_TYPES = ("qwen2",)
"""Decoders this adapter runs (InternVL3's); others (e.g. InternVL3.5's qwen3) are refused."""


@dataclass
class InternVL(HFVisionLM):
    """A loaded InternVL3 checkpoint and the pieces apbv drives (see the module docstring)."""

    model: InternVLForConditionalGeneration
    temporal_patch_size: int = 1
    """Frames per temporal unit: one (ranks and stream chunks hold whole frames)."""
    extra_levels = 0
    """Tower rows are the projected embeddings alone."""
    frame_multiple = 28
    """A stream's frame sides are multiples of this (pixels; its processor resizes them to
    448x448 whatever they are: Qwen2.5-VL's rule, kept)."""

    @property
    def family(self) -> str:
        return FAMILY

    @property
    def video_token_id(self) -> int:
        return self.model.config.image_token_id

    @property
    def spatial_merge_size(self) -> int:
        """Patch rows and columns per token side: 2 for the pixel shuffle at ratio 0.5."""
        return round(1 / self.model.config.downsample_ratio)

    @property
    def tokens_per_second(self) -> float:
        """0: positions carry no time (1-D RoPE)."""
        return 0.0

    @property
    def patch_grid(self) -> tuple[int, int]:
        """(h, w) patches of one frame (32, 32 for 448x448 frames in 14x14 patches)."""
        size, patch = self.vision_config.image_size, self.vision_config.patch_size
        return size[0] // patch[0], size[1] // patch[1]

    def set_vision(self, vision: VisionConfig) -> None:
        """Patch rows per tower call from ``vision.chunk_rows`` (unset: one call per share);
        the other settings are Qwen2.5-VL's tower's (:mod:`apbv.model.common.tower`): the stock
        InternViT runs as it is."""
        self.chunk_rows = vision.chunk_rows or 0

    def process_frames(self, frames: torch.Tensor, *, levels: bool = False,
                       ) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Frames (F, 3, H, W) uint8 of any size -> the stock video processor's pixel values
        (F, 3, 448, 448) (resized, rescaled and normalised) and the (F, h, w) patch grid.
        ``levels`` is not supported (the processor resizes: it always gives float rows)."""
        if not isinstance(frames, torch.Tensor) or frames.dtype != torch.uint8 \
                or frames.dim() != 4 or frames.shape[1] != 3 or frames.shape[0] < 1:
            got = (f"{frames.dtype} {tuple(frames.shape)}" if isinstance(frames, torch.Tensor)
                   else type(frames).__name__)
            raise ValueError(f"frames must be a uint8 tensor (F, 3, H, W) with F >= 1, got {got}")
        if levels:
            raise ValueError(f"{FAMILY} frames are processed by its processor: no pixel levels")
        processed = self.processor.video_processor(videos=[frames], do_sample_frames=False,
                                                   return_tensors="pt")
        pixels = processed["pixel_values_videos"][0]
        return pixels, (pixels.shape[0], *self.patch_grid)

    def tower_rows(self, frames: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        return self.process_frames(frames)

    def frames_per_chunk(self, height: int, width: int) -> int:
        """Frames per chunk of :meth:`encode_frames`: about :attr:`chunk_rows` patch rows
        (else the pipeline's chunk), at least one frame (frames are resized to 448x448
        whatever ``height`` and ``width``)."""
        rows = self.patch_grid[0] * self.patch_grid[1]
        return max(1, (self.chunk_rows or PIPELINE_CHUNK_ROWS) // rows)

    def vision_tower(self, pixel_values: torch.Tensor,
                     grid_thw: torch.Tensor | tuple[int, int, int]) -> torch.Tensor:
        """Pixel values (F, 3, 448, 448) of whole frames -> embeddings (F * 256, hidden) in
        frame order: InternViT, pixel shuffle and projector per frame (the stock
        ``get_image_features``), :attr:`chunk_rows` patch rows per call."""
        frames = int(torch.as_tensor(grid_thw).reshape(-1, 3)[:, 0].sum())
        if pixel_values.dim() != 4 or pixel_values.shape[0] != frames:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not match the grid "
                             f"{torch.as_tensor(grid_thw).tolist()} ({frames} frames)")
        per_call = self.frames_per_chunk(0, 0) if self.chunk_rows else frames
        outs = []
        for first in range(0, frames, per_call):
            rows = pixel_values[first:first + per_call].to(self.device, self.dtype)
            out = tower_output(self.model.model.get_image_features(pixel_values=rows))
            outs.append(out.reshape(-1, out.shape[-1]))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @property
    def rules(self) -> InternVLRules:
        """The weight-free frame choice and prompt (:mod:`apbv.model.internvl.prompt`)."""
        return InternVLRules(self.processor)

    def prompt_ids(self, question: str, num_frames: int, system: str | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Context ids (N,) and query ids (Q,) over ``num_frames`` frames, as the stock
        processor builds them (:func:`apbv.model.internvl.prompt.internvl_prompt_ids`)."""
        return self.rules.prompt_ids(question, num_frames, system)

    def prompt(self, question: str, video_grid: tuple[int, int, int],
               system: str | None = None, *, sampling: Sampling | None = None,
               kept: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rules.prompt(question, video_grid, system, kept=kept)

    def plan_sampling(self, spec: VideoSpec, meta: VideoMeta) -> Sampling:
        return self.rules.plan_sampling(spec, meta)

    def video_grid(self, sampling: Sampling) -> tuple[int, int, int]:
        return self.rules.video_grid(sampling)

    def positions(self, ids: torch.Tensor, video_grid: tuple[int, int, int],
                  second_per_grid_t: float, kept: Sequence[int] | None = None) -> torch.Tensor:
        """(3, 1, T) 1-D RoPE positions 0..T-1 of the prompt ``ids`` (T,), in three equal rows
        (the video's grid, time and ``kept`` frames do not move them)."""
        return sequential_positions(0, len(ids))

    def stream_prompt(self, grid_hw: tuple[int, int]) -> InternVLStreamPrompt:
        """The live-stream pieces of :meth:`prompt_ids`' prompt (``grid_hw`` is always the
        448x448 frame's patch grid here)."""
        return InternVLStreamPrompt(self.processor)

    def decoder(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                video_features: VideoFeatures | None = None) -> torch.Tensor:
        """The decoder layers and final norm on (1, T, hidden) with positions (3, 1, T) (the
        first row is the 1-D position) or (1, T); attention through the installed
        :class:`apbv.context.AttentionContext`."""
        assert video_features is None, "InternVL3 has no extra vision features"
        if position_ids.dim() == 3:
            position_ids = position_ids[0]
        return self.run_decoder(inputs_embeds, position_ids)


def load(path: str | Path, *, device: torch.device, dtype: torch.dtype,
         vision: VisionConfig | None = None) -> InternVL:
    """Load an InternVL3 checkpoint directory (no downloads). Checked first: a wrong or
    incomplete directory, or a decoder other than :data:`TEXT_MODEL_TYPES`, is a ValueError
    before any weight is read."""
    return load_stock(InternVL, InternVLForConditionalGeneration, path, model_type=MODEL_TYPE,
                      family=FAMILY, device=device, dtype=dtype, vision=vision,
                      text_types=TEXT_MODEL_TYPES)
