"""What the server's front end asks of a model family before any rank works, from the
checkpoint's processor alone (no weights): the frame choice, the patch grid and the prompt,
by the same functions the engine's adapters use, so the limits it checks (frames, pixels,
prompt tokens) are those of the request the engine will run.

:func:`prompt_rules` picks the family by the processor's class (the checkpoint's
``processor_config.json``; :attr:`apbv.model.families.Family.processor`), and refuses another
family naming the supported ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from apbv.model.families import FAMILIES

if TYPE_CHECKING:
    import torch

    from apbv.video import Sampling, VideoMeta, VideoSpec


class PromptRules(Protocol):
    """A family's frame choice, patch grid and prompt (see
    :class:`apbv.model.adapter.VideoModel`, whose methods of the same names they are)."""

    def plan_sampling(self, spec: VideoSpec, meta: VideoMeta) -> Sampling: ...

    def video_grid(self, sampling: Sampling) -> tuple[int, int, int]: ...

    def prompt(self, question: str, video_grid: tuple[int, int, int],
               system: str | None = None, *, sampling: Sampling | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]: ...


def prompt_rules(processor: Any) -> PromptRules:
    """The :class:`PromptRules` of the family whose processor ``processor`` is (its
    :attr:`apbv.model.families.Family.rules`)."""
    name = type(processor).__name__
    for family in FAMILIES.values():
        if family.processor == name:
            rules: PromptRules = family.part("prompt", family.rules)(processor)
            return rules
    raise ValueError(f"no prompt rules for a {name}; supported: "
                     f"{', '.join(f.processor for f in FAMILIES.values())}")
