"""Checks on a checkpoint directory before any weight is read (no transformers import).

:func:`validate_checkpoint` reads only ``config.json`` (and ``processor_config.json`` where no
per-part processor file is there) and the names of the other files, so a wrong directory (a
text-only model, a half-copied download) fails in milliseconds with a ValueError naming what is
wrong, instead of after minutes of loading or with a traceback from deep inside transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
"""One of these holds the weights (the index lists its shards)."""

PER_PART_PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json")
"""The image and video processors' settings as transformers 4.x and the released checkpoints
store them (transformers 5 saves them inside ``processor_config.json`` instead)."""


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON (truncated or corrupt?): {exc}") from None


def supported_text(supported: Mapping[str, str]) -> str:
    """``'qwen2_5_vl' (Qwen2.5-VL), ...``: the model types of ``supported`` (model type ->
    family name) as an error message lists them."""
    return ", ".join(f"{model_type!r} ({name})" for model_type, name in supported.items())


def read_config(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path``'s ``config.json``; ValueError when it is missing, unreadable,
    not valid JSON or not an object."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    config = _read_json(config_file)
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} must hold a JSON object, got {type(config).__name__}")
    return config


def _check_config(path: Path, supported: Mapping[str, str]) -> dict[str, Any]:
    config = read_config(path)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in supported:
        what = "has no model_type" if model_type is None else f"is a {model_type!r} checkpoint"
        raise ValueError(f"{str(path)!r} {what}; supported: {supported_text(supported)}")
    if not isinstance(config.get("vision_config"), dict):
        raise ValueError(f"{path / 'config.json'} has no vision_config: not a vision-language "
                         "checkpoint")
    return config


def _check_weights(path: Path) -> None:
    if (path / "model.safetensors").is_file() or (path / "pytorch_model.bin").is_file():
        return
    index_file = path / "model.safetensors.index.json"
    if not index_file.is_file():
        raise ValueError(f"model directory {str(path)!r} has no weights: none of "
                         f"{', '.join(WEIGHT_FILES)}")
    index = _read_json(index_file)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_file} has no weight_map")
    shards = sorted(set(map(str, weight_map.values())))
    missing = [name for name in shards if not (path / name).is_file()]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5
                                          else "")
        raise ValueError(f"model directory {str(path)!r} lacks {len(missing)} of the "
                         f"{len(shards)} weight shards listed in {index_file.name}: {shown}")


def _holds_processor_parts(path: Path) -> bool:
    """Whether ``path`` is a ``processor_config.json`` holding the image or the video processor's
    settings (transformers 5 saves a processor as this one file; 4.x wrote only the processor's
    own options there, next to the per-part files)."""
    if not path.is_file():
        return False
    config = _read_json(path)
    return isinstance(config, dict) and any(
        isinstance(config.get(part), dict) for part in ("image_processor", "video_processor"))


def _check_processor_files(path: Path) -> None:
    missing = []
    if not (path / "tokenizer_config.json").is_file():
        missing.append("tokenizer_config.json")
    if not (path / "tokenizer.json").is_file() and not (
        (path / "vocab.json").is_file() and (path / "merges.txt").is_file()
    ):
        missing.append("tokenizer.json (or vocab.json and merges.txt)")
    if not any((path / name).is_file() for name in PER_PART_PROCESSOR_FILES) and \
            not _holds_processor_parts(path / "processor_config.json"):
        missing.append("preprocessor_config.json (or a processor_config.json holding the "
                       "image or video processor, as transformers 5 saves it)")
    if missing:
        raise ValueError(f"model directory {str(path)!r} lacks the tokenizer/processor files: "
                         f"{', '.join(missing)}")


def validate_checkpoint(path: str | Path, supported: Mapping[str, str]) -> Path:
    """Check that ``path`` is a complete local checkpoint of one of the ``supported`` model
    types (``config.json``'s ``model_type`` -> family name); return it as a Path.

    Raises ValueError naming the problem: no such directory; ``config.json`` missing,
    unreadable or not valid JSON; a model type not in ``supported`` (the message lists them) or
    no
    ``vision_config``; no weights (``model.safetensors``, ``model.safetensors.index.json`` with
    all its shards, or ``pytorch_model.bin``); tokenizer or processor files missing (the
    processor's settings: ``preprocessor_config.json`` or ``video_preprocessor_config.json`` as
    in 4.x and the released checkpoints, or ``processor_config.json`` holding them as
    transformers 5 saves it).
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"model directory {str(path)!r} does not exist")
    _check_config(path, supported)
    _check_weights(path)
    _check_processor_files(path)
    return path
