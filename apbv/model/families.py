"""The model families apbv runs, chosen by a checkpoint's ``config.json`` ``model_type``.

:data:`FAMILIES` is the one registry: model type -> the family's name and the module holding
its adapter (:class:`apbv.model.adapter.VideoModel`; each module has ``load(path, *, device,
dtype, vision)``). :func:`load_adapter` checks the directory first
(:func:`apbv.model.checkpoint.validate_checkpoint`, JSON and file names only): a checkpoint of
another family is refused, naming the supported ones, before transformers is imported or any
weight is read. The engine loads through :func:`load_adapter` and names no family module.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from apbv.model.checkpoint import read_config, supported_text, validate_checkpoint

if TYPE_CHECKING:
    import torch

    from apbv.config import VisionConfig
    from apbv.model.adapter import VideoModel


@dataclass(frozen=True)
class Family:
    """A supported model family: its name (as ``/v1/models`` reports it) and the module of its
    adapter."""

    name: str
    module: str


FAMILIES: dict[str, Family] = {
    "qwen2_5_vl": Family("Qwen2.5-VL", "apbv.model.qwen2_5_vl.adapter"),
    "internvl": Family("InternVL3", "apbv.model.internvl.adapter"),
    "qwen3_vl": Family("Qwen3-VL", "apbv.model.qwen3_vl.adapter"),
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
    family = family_of(path)
    module = importlib.import_module(family.module)
    return module.load(path, device=device, dtype=dtype, vision=vision)
