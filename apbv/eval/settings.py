"""The settings of an evaluation run, stored with its output and checked on resume.

Everything that changes a sample's answer or how it is scored is one entry of a flat dict
(``model.path``, ``video.nframes``, ``max_new_tokens``, ...). The first run on an output writes
it to ``OUT_settings.json`` (and every results file carries it under ``config.apbv.settings``);
a run that resumes that output recomputes it and refuses, before any sample runs, when any entry
differs: results of two settings in one file would be scored as one run.

Not settings: ``--limit`` and ``--where`` (they pick samples; the rows do not depend on them),
``--no-retry-failed`` and ``--skip-missing`` (what to run, not how). ``model.dtype`` and
``attention.kernel`` are stored as configured ("auto" and None let the device decide).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import apbv
from apbv.config import RuntimeConfig

VIDEO_KEYS = ("fps", "nframes", "min_pixels", "max_pixels", "total_pixels", "backend")


def file_digest(path: str | os.PathLike[str]) -> str | None:
    """The sha256 of a file's bytes, None when it is no file."""
    path = Path(path)
    if not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_settings(spec: Any, cfg: RuntimeConfig, *, annotation: Path,
                 world_size: int) -> dict[str, Any]:
    """The settings of the run ``spec`` (an :class:`apbv.eval.harness.EvalSpec`) with ``cfg``
    on ``world_size`` ranks, as JSON values."""
    model = cfg.model.path
    settings: dict[str, Any] = {
        "bench": spec.bench,
        "task": spec.task,
        "annotation": os.path.abspath(annotation),
        "annotation_sha256": file_digest(annotation),
        "model.path": os.path.abspath(model) if model else model,
        "model.config_sha256": file_digest(Path(model) / "config.json") if model else None,
        "model.dtype": cfg.model.dtype,
        **{f"video.{k}": getattr(cfg.video, k) for k in VIDEO_KEYS},
        "max_new_tokens": spec.new_tokens,
        "mode": spec.mode,
        "compare": spec.compare,
        "attention.anchor_len": cfg.attention.anchor_len,
        "attention.passing_len": cfg.attention.passing_len,
        "attention.kernel": cfg.attention.kernel,
        "world_size": world_size,
        "apbv_version": apbv.__version__,
    }
    if cfg.video.static_threshold:  # only when on, so outputs of earlier runs still resume
        settings["video.static_threshold"] = cfg.video.static_threshold
    if cfg.video.pruning_rate:
        settings["video.pruning_rate"] = cfg.video.pruning_rate
    return json.loads(json.dumps(settings))  # what a reader of the file gets back


def settings_path(out: str | os.PathLike[str]) -> Path:
    """``OUT_settings.json`` next to ``OUT.jsonl``."""
    out = Path(out)
    return out.with_name(f"{out.name.removesuffix('.jsonl')}_settings.json")


def write_settings(out: str | os.PathLike[str], settings: dict[str, Any]) -> None:
    """Write the settings file whole (a crash leaves the old file or the new one)."""
    path = settings_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"apbv_eval_settings": settings}, indent=1) + "\n",
                   encoding="utf-8")
    os.replace(tmp, path)


def read_settings(out: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The stored settings; None when there is no settings file."""
    path = settings_path(out)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        settings = data["apbv_eval_settings"]
    except (ValueError, KeyError, TypeError):
        settings = None
    if not isinstance(settings, dict):
        raise ValueError(f"{path} is not a settings file of apbv eval; delete {out} and {path} "
                         f"to start over, or pass another --out")
    return settings


def check_settings(out: str | os.PathLike[str], stored: dict[str, Any] | None,
                   new: dict[str, Any], rows: int) -> None:
    """Refuse to resume ``out`` (holding ``rows`` rows) under settings other than its own."""
    if stored is None:
        raise ValueError(f"{out} holds {rows} result rows but no settings file "
                         f"({settings_path(out).name}; written by an older apbv?), so this run "
                         f"cannot check that they came from the same model and settings; pass "
                         f"another --out, or delete {out} to start over")
    keys = list(new) + [k for k in stored if k not in new]
    missing = object()
    differing = [f"{k} stored {json.dumps(stored.get(k))}, now {json.dumps(new.get(k))}"
                 for k in keys if stored.get(k, missing) != new.get(k, missing)]
    if differing:
        raise ValueError(f"{out} holds results of other settings than this run's "
                         f"({'; '.join(differing)}); resuming would mix them: pass another "
                         f"--out, or delete {out} (and {settings_path(out).name}) to start over")
