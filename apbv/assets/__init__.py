"""Files shipped inside the package.

``needle-tiny/``: the tiny Qwen2.5-VL trained on synthetic needle videos
(:mod:`apbv.synthetic.train_tiny`; ``training.json`` beside the weights records the command, seed,
steps, wall time and held-out accuracy). It loads like a released checkpoint::

    Qwen2_5_VLForConditionalGeneration.from_pretrained(NEEDLE_TINY, local_files_only=True)

``camera-tiny/``: ``needle-tiny`` continued on static-camera videos beside its free-form needle
questions (``train-tiny --mix camera``; its ``training.json`` names the starting weights), the
checkpoint of the static-camera figures (docs/pruning.md). ``needle-tiny`` stays the default:
the continuation answers some free-form kinds less well (docs/tiny_model.md).
"""

from __future__ import annotations

from pathlib import Path

NEEDLE_TINY = Path(__file__).resolve().parent / "needle-tiny"
"""The trained tiny checkpoint directory."""
CAMERA_TINY = Path(__file__).resolve().parent / "camera-tiny"
"""Its continuation on static-camera videos."""


def needle_tiny() -> Path:
    """:data:`NEEDLE_TINY`, checked to hold its weights (a ValueError names what is missing)."""
    if not (NEEDLE_TINY / "model.safetensors").is_file():
        raise ValueError(f"the trained tiny checkpoint is missing from {NEEDLE_TINY} (retrain it: "
                         "python -m apbv train-tiny --out apbv/assets/needle-tiny)")
    return NEEDLE_TINY
