"""What the server's front end asks of a model family before any rank works, from the
checkpoint's processor alone (no weights): the frame choice, the patch grid and the prompt,
by the same functions the engine's adapters use, so the limits it checks (frames, pixels,
prompt tokens) are those of the request the engine will run.

:func:`prompt_rules` picks the family by the processor's class (the checkpoint's
``processor_config.json``), and refuses another family naming the supported ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from apbv.sequence import build_prompt
from apbv.video import Sampling, VideoMeta, VideoSpec, plan_sampling


class PromptRules(Protocol):
    """A family's frame choice, patch grid and prompt (see
    :class:`apbv.model.adapter.VideoModel`, whose methods of the same names they are)."""

    def plan_sampling(self, spec: VideoSpec, meta: VideoMeta) -> Sampling: ...

    def video_grid(self, sampling: Sampling) -> tuple[int, int, int]: ...

    def prompt(self, question: str, video_grid: tuple[int, int, int],
               system: str | None = None, *, sampling: Sampling | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]: ...


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


PROCESSORS = {"Qwen2_5_VLProcessor": "qwen2_5_vl", "InternVLProcessor": "internvl",
              "Qwen3VLProcessor": "qwen3_vl"}
"""Processor class -> ``model_type`` of the family it belongs to."""


def prompt_rules(processor: Any) -> PromptRules:
    """The :class:`PromptRules` of the family whose processor ``processor`` is."""
    kind = PROCESSORS.get(type(processor).__name__)
    if kind == "internvl":
        from apbv.model.internvl.prompt import InternVLRules

        return InternVLRules(processor)
    if kind == "qwen3_vl":
        from apbv.model.qwen3_vl.prompt import Qwen3VLRules

        return Qwen3VLRules(processor)
    if kind == "qwen2_5_vl":
        return QwenRules(processor)
    raise ValueError(f"no prompt rules for a {type(processor).__name__}; supported: "
                     f"{', '.join(PROCESSORS)}")
