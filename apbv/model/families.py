"""The model families apbv runs, chosen by a checkpoint's ``config.json`` ``model_type``.

:data:`FAMILIES` is the one registry: model type -> a :class:`Family` row naming the family's
folder (``apbv/model/<folder>/``: ``adapter.py`` with ``load(path, *, device, dtype,
vision)``, ``prompt.py`` with the weight-free prompt rules, ``tiny.py`` with the tiny checkpoint
writer), the processor class its checkpoints load, the rules class and tiny writer by name, and
its lmms-eval prompt. Nothing of a family is imported here (the command line's help stays
fast); :func:`load_adapter`, :func:`apbv.model.front.prompt_rules` and
:func:`write_tiny_family` import the one they need.

:func:`load_adapter` checks the directory first (:func:`apbv.model.checkpoint.
validate_checkpoint`, JSON and file names only): a checkpoint of another family is refused,
naming the supported ones, before transformers is imported or any weight is read. The engine
loads through :func:`load_adapter` and names no family module. (``apbv/cost/`` reads
``model_type`` on its own: it imports nothing of ``apbv.model``.)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apbv.model.checkpoint import read_config, supported_text, validate_checkpoint

if TYPE_CHECKING:
    import torch

    from apbv.config import VisionConfig
    from apbv.model.adapter import VideoModel

QWEN_SYSTEM = "You are a helpful assistant."
"""The ``system_prompt`` default of lmms-eval's qwen2_5_vl and qwen3_vl wrappers."""
INTERNVL_SYSTEM = ("你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位"
                   "联合开发的多模态大语言模型。")
"""The ``system_message`` of InternVL's ``internvl2_5`` conversation template."""


@dataclass(frozen=True)
class EvalPrompt:
    """What a family's lmms-eval wrapper adds around the task's text
    (:mod:`apbv.eval.prompts`)."""

    system: str | None
    """The system turn's text (None: the chat template's default turn is the wrapper's)."""
    wrapper: str
    """The lmms-eval model wrapper it follows (its file in lmms-eval)."""


@dataclass(frozen=True)
class Family:
    """A supported model family: its name (as ``/v1/models`` reports it), its folder's package
    and what the registry's users take from it by name."""

    name: str
    package: str
    """``apbv.model.<folder>``: ``.adapter`` (``load``), ``.prompt`` and ``.tiny``."""
    processor: str
    """The class name of the processor its checkpoints load (the server's front end picks
    the prompt rules by it)."""
    rules: str
    """The prompt rules class in ``<package>.prompt`` (:class:`apbv.model.front.PromptRules`,
    made from the processor)."""
    tiny: str
    """The tiny checkpoint writer in ``<package>.tiny``: ``(out, *, seed, overwrite)``, plus
    ``size`` (checked by the writer) where :attr:`tiny_sizes` has more than one."""
    eval_prompt: EvalPrompt
    tiny_sizes: tuple[str, ...] = ("tiny",)
    """``make-tiny-model --size`` values the writer takes."""

    @property
    def module(self) -> str:
        """The module of its adapter (:class:`apbv.model.adapter.VideoModel`)."""
        return f"{self.package}.adapter"

    def part(self, module: str, name: str) -> Any:
        """``name`` from the family's ``<package>.<module>`` (imported now)."""
        return getattr(importlib.import_module(f"{self.package}.{module}"), name)


FAMILIES: dict[str, Family] = {
    "qwen2_5_vl": Family("Qwen2.5-VL", "apbv.model.qwen2_5_vl", "Qwen2_5_VLProcessor",
                         "QwenRules", "write_tiny_checkpoint",
                         EvalPrompt(None, "lmms_eval/models/simple/qwen2_5_vl.py"),
                         tiny_sizes=("tiny", "medium")),
    "internvl": Family("InternVL3", "apbv.model.internvl", "InternVLProcessor",
                       "InternVLRules", "write_tiny_internvl",
                       EvalPrompt(INTERNVL_SYSTEM, "lmms_eval/models/simple/internvl3.py")),
    "qwen3_vl": Family("Qwen3-VL", "apbv.model.qwen3_vl", "Qwen3VLProcessor",
                       "Qwen3VLRules", "write_tiny_qwen3_vl",
                       EvalPrompt(QWEN_SYSTEM, "lmms_eval/models/simple/qwen3_vl.py")),
}
"""``config.json`` ``model_type`` -> :class:`Family`."""

SUPPORTED: dict[str, str] = {model_type: f.name for model_type, f in FAMILIES.items()}
"""``model_type`` -> family name, as :func:`apbv.model.checkpoint.validate_checkpoint` takes
them."""

REFUSED_VARIANTS: dict[str, str] = {
    "qwen3_vl_moe": "Qwen3-VL's mixture-of-experts variant ('qwen3_vl_moe', e.g. "
                    "Qwen3-VL-30B-A3B) is not supported: apbv runs the dense Qwen3-VL "
                    "('qwen3_vl', e.g. Qwen3-VL-8B)",
}
"""Model types of a supported family's variants that apbv does not run -> why (named before
the general refusal, from ``config.json`` alone)."""

TINY_FAMILIES = tuple(FAMILIES)
"""``config.json`` model types :func:`write_tiny_family` writes (``make-tiny-model
--family``)."""


def family_of(path: str | Path) -> Family:
    """The family of the checkpoint directory ``path``, after checking the directory
    (ValueError naming the problem, and the supported model types for another family)."""
    if (Path(path) / "config.json").is_file():
        model_type = read_config(path).get("model_type")
        refused = REFUSED_VARIANTS.get(model_type) if isinstance(model_type, str) else None
        if refused is not None:
            raise ValueError(f"{str(path)!r}: {refused}; supported: {supported_text(SUPPORTED)}")
    validate_checkpoint(path, SUPPORTED)
    return FAMILIES[read_config(path)["model_type"]]


def load_adapter(path: str | Path, *, device: torch.device, dtype: torch.dtype,
                 vision: VisionConfig | None = None) -> VideoModel:
    """Load the checkpoint directory ``path`` (no downloads) with its family's adapter, its
    vision tower set up by ``vision`` (None: the defaults). Checked first (:func:`family_of`):
    a wrong, incomplete or unsupported checkpoint is a ValueError before any weight is read."""
    load = family_of(path).part("adapter", "load")
    adapter: VideoModel = load(path, device=device, dtype=dtype, vision=vision)
    return adapter


def write_tiny_family(family: str, out: str | Path, *, seed: int = 0, overwrite: bool = False,
                      size: str = "tiny") -> Path:
    """Write the tiny checkpoint of ``family`` (a ``model_type`` of :data:`TINY_FAMILIES`) to
    ``out`` with its writer (:attr:`Family.tiny`); ``size`` one of its :attr:`Family.tiny_sizes`
    (ValueError naming the family that has it otherwise)."""
    row = FAMILIES.get(family)
    if row is None:
        raise ValueError(f"unknown family {family!r}; allowed: {', '.join(TINY_FAMILIES)}")
    if len(row.tiny_sizes) > 1:  # the writer checks the size
        sized: Path = row.part("tiny", row.tiny)(out, seed=seed, overwrite=overwrite, size=size)
        return sized
    if size not in row.tiny_sizes:
        others = ", ".join(t for t, f in FAMILIES.items() if size in f.tiny_sizes)
        said = f"--size {size} is for the {others} family" if others else \
            f"unknown size {size!r}"
        raise ValueError(f"{said}; {family} has {', '.join(row.tiny_sizes)} only")
    path: Path = row.part("tiny", row.tiny)(out, seed=seed, overwrite=overwrite)
    return path
