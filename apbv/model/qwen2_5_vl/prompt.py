"""Qwen2.5-VL's weight-free rules: qwen-vl-utils' frame choice and resize, the patch grid, the
one-shot prompt (one run of ``<|video_pad|>``) and a live stream's prompt pieces, from the
processor alone, as the adapter (:class:`apbv.model.qwen2_5_vl.adapter.QwenVL`) and the
server's front end (:func:`apbv.model.front.prompt_rules`) both use them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from apbv.model.stream_prompt import ChunkPlace, split_at_video
from apbv.positions import video_positions
from apbv.sequence import VIDEO_PAD, build_prompt
from apbv.video import Sampling, VideoMeta, VideoSpec, plan_sampling


@dataclass(frozen=True)
class QwenRules:
    """Qwen2.5-VL: qwen-vl-utils' sampling and resize, one run of ``<|video_pad|>``."""

    processor: Any

    def plan_sampling(self, spec: VideoSpec, meta: VideoMeta) -> Sampling:
        return plan_sampling(spec, meta)

    def video_grid(self, sampling: Sampling) -> tuple[int, int, int]:
        return sampling.grid_thw

    def prompt(self, question: str, video_grid: tuple[int, int, int],
               system: str | None = None, *, sampling: Sampling | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        t, h, w = video_grid
        merge = getattr(self.processor.video_processor, "merge_size", 2)
        return build_prompt(self.processor, question, t * (h // merge) * (w // merge), system)


@dataclass
class QwenStreamPrompt:
    """Qwen2.5-VL: the chunk is its ``len(patches) * gh * gw`` ``<|video_pad|>`` tokens at the
    one-shot M-RoPE positions (temporal patch ``g`` at ``floor(g * seconds_per_patch *
    tokens_per_second)``, all after the header); ``gh`` x ``gw``: a frame's merged grid."""

    processor: Any
    merged_hw: tuple[int, int]
    tokens_per_second: float

    def __post_init__(self) -> None:
        self.pad = self.processor.tokenizer.convert_tokens_to_ids(VIDEO_PAD)
        self.header, self.after = split_at_video(self.processor)

    def chunk(self, place: ChunkPlace) -> tuple[torch.Tensor, torch.Tensor]:
        gh, gw = self.merged_hw
        positions = video_positions(place.patches, gh, gw, place.seconds_per_patch,
                                    self.tokens_per_second, place.video_start).unsqueeze(1)
        return torch.full((positions.shape[-1],), self.pad, dtype=torch.long), positions
