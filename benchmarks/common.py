"""Pieces the benchmark scripts share: the model arguments and the plot's set-up and finish.

The scripts run as ``python benchmarks/NAME.py``, so this directory is on ``sys.path``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

STOCK_TOWER = ("vision.attention=per_window", "vision.patch_embed=conv", "vision.rotary=stock",
               "vision.norm=stock", "vision.mlp_pad=0", "vision.chunk_rows=0")
"""Config overrides for transformers' stock vision tower: one SDPA call per window, the
Conv3d patch embedding, the rotary on strided q/k, its own norms and MLP width, the rank's
whole video in one call."""


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--model`` (a checkpoint directory) or ``--size`` of a generated random one."""
    parser.add_argument("--model", help="checkpoint directory (default: a generated random one)")
    parser.add_argument("--size", default="tiny", choices=("tiny", "medium"),
                        help="random model size when --model is not given")


def model_dir(args: argparse.Namespace, root: Path) -> str:
    """``args.model``, or a random checkpoint of ``args.size`` written under ``root``."""
    if args.model is not None:
        return args.model
    from apbv.model.qwen2_5_vl.tiny import write_tiny_checkpoint

    return str(write_tiny_checkpoint(root / f"{args.size}-model", size=args.size))


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or None (said on stderr) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("[bench] matplotlib is not installed: no plot (pip install matplotlib)",
              file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, *, styled: Any = (), dpi: int = 120) -> bool:
    """Grid and legend on every axis of ``styled``, tight layout, written to ``path``;
    True."""
    for ax in styled:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    return True


def print_table(lines: list[str], out: str | None) -> None:
    """Print the Markdown ``lines`` on stdout and, when ``out`` is given, write them there."""
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def finish_calibration(out: str, report: dict[str, Any], name: str, started: float) -> None:
    """Add the torch version, the machine and the seconds since ``started``
    (``time.perf_counter``) to a calibration ``report`` and write it
    (:func:`apbv.cost.hardware.write_calibration`)."""
    import platform
    import time

    import torch

    from apbv.cost.hardware import write_calibration

    report = {**report, "torch": torch.__version__, "machine": platform.machine(),
              "seconds": time.perf_counter() - started}
    write_calibration(out, report, name)
