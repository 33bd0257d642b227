"""What the subcommands share: the config flags and their overrides, the rank set-up and
teardown, and the one way bad input is reported (an ``error:`` line, exit status 2)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from apbv import MissingExtra
from apbv.modes import MODE_NAMES

if TYPE_CHECKING:  # the command line starts without torch (apbv.distributed imports it)
    from apbv.config import RuntimeConfig
    from apbv.distributed import DistInfo


def add_plan_args(p: argparse.ArgumentParser, *, context_len: int, world_size: int) -> None:
    p.add_argument("--context-len", type=int, default=context_len,
                   help="N, tokens before the query")
    p.add_argument("--query-len", type=int, default=64, help="Q, tokens of the query")
    p.add_argument("--world-size", type=int, default=world_size, help="H, number of ranks")
    p.add_argument("--anchor-len", type=int, default=None, help="A (default about N/64)")
    p.add_argument("--passing-len", type=int, default=None, help="P (default about N/128)")


def add_config_args(p: argparse.ArgumentParser, default_preset: str | None) -> None:
    p.add_argument("--config", default=default_preset,
                   help="TOML preset name (configs/, shipped in the package) or a path "
                        "(default: %(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. --set attention.passing_len=256")
    p.add_argument("--model", help="checkpoint directory (model.path)")
    p.add_argument("--mode", choices=MODE_NAMES, help="mode (attention.mode)")
    frames = p.add_mutually_exclusive_group()
    frames.add_argument("--fps", type=float, help="frames sampled per second (video.fps)")
    frames.add_argument("--nframes", type=int, help="frames to sample (video.nframes)")
    p.add_argument("--min-pixels", type=int, help="per-frame pixel floor (video.min_pixels)")
    p.add_argument("--max-pixels", type=int, help="per-frame pixel cap (video.max_pixels)")
    p.add_argument("--video-backend", choices=("decord", "pyav"), help="video.backend")
    p.add_argument("--max-new-tokens", type=int, help="generate.max_new_tokens")


def add_group_args(p: argparse.ArgumentParser, items: str) -> None:
    """``--groups`` and ``--fail-on-error`` of the runs over many ``items`` (eval, batch)."""
    p.add_argument("--groups", type=int, default=1, metavar="G",
                   help="run the world as G sequence-parallel groups of world/G ranks, each "
                        f"answering its share of the {items} (default: 1)")
    p.add_argument("--fail-on-error", action="store_true",
                   help="exit 1 when a row failed (default: exit 0 once every row is written, "
                        "failed rows included; the last line counts them)")


def config_from_args(args: argparse.Namespace) -> RuntimeConfig:
    """The :class:`~apbv.config.RuntimeConfig` of ``--config`` with ``--set`` and the flags of
    :func:`add_config_args` applied (a flag wins over ``--set``)."""
    from apbv.config import load_config

    overrides = list(args.set)
    for flag, key in (("model", "model.path"), ("mode", "attention.mode"),
                      ("fps", "video.fps"), ("nframes", "video.nframes"),
                      ("min_pixels", "video.min_pixels"),
                      ("max_pixels", "video.max_pixels"), ("video_backend", "video.backend"),
                      ("max_new_tokens", "generate.max_new_tokens")):
        value = getattr(args, flag)
        if value is not None:  # as TOML: floats keep nan/inf (json writes NaN, Infinity)
            text = repr(value).lower() if isinstance(value, float) else json.dumps(value)
            overrides.append(f"{key}={text}")
    return load_config(config_name(args.config), overrides)  # --nframes replaces its fps


def preset_alias(name: str) -> str | None:
    """The config preset that ``name`` means when it spells a model as ``plan --preset`` does
    (``qwen2.5-vl-7b``: ``qwen2_5_vl_7b_8gpu``, the one preset of that model); None when
    ``name`` is a preset itself, a path, or names no preset's model; ValueError naming the
    presets when several match."""
    from apbv.config import preset_names

    names = preset_names()
    stem = name.strip().lower().replace(".", "_").replace("-", "_")
    if name in names or name.endswith(".toml") or not stem:
        return None
    found = [n for n in names if n == stem or (n.startswith(stem + "_") and
                                                n[len(stem) + 1:].removesuffix("gpu").isdigit())]
    if len(found) > 1:
        raise ValueError(f"--config {name!r} names the model of several presets: "
                         f"{', '.join(found)}; give one of them")
    return found[0] if found else None


def config_name(name: str | None) -> str | None:
    """``--config``'s preset: ``name``, or the preset it spells as ``plan --preset`` does
    (:func:`preset_alias`), with a note on stderr."""
    alias = preset_alias(name) if name else None
    if alias is None:
        return name
    print(f"note: --config {name!r} read as {alias!r} (the configs' spelling of that model)",
          file=sys.stderr)
    return alias


def require_model(cfg: RuntimeConfig) -> None:
    """ValueError unless the config names a checkpoint (``--model`` or ``model.path``)."""
    if not cfg.model.path:
        raise ValueError("no model: pass --model DIR or set model.path in the config")


@contextmanager
def distributed(cfg: RuntimeConfig) -> Iterator[DistInfo]:
    """This process's rank (:class:`~apbv.distributed.DistInfo`) under torchrun (or alone),
    with ``parallel.backend``, ``parallel.timeout_s`` and ``parallel.startup_timeout_s``; the
    process group is destroyed on the way out."""
    from apbv.distributed import destroy_distributed, init_distributed

    backend = None if cfg.parallel.backend == "auto" else cfg.parallel.backend
    info = init_distributed(backend=backend, timeout_s=cfg.parallel.timeout_s,
                            startup_timeout_s=cfg.parallel.startup_timeout_s)
    try:
        yield info
    finally:
        destroy_distributed()


def run_reporting_errors(run: Callable[[argparse.Namespace], int],
                         args: argparse.Namespace) -> int:
    """``run(args)``, with bad input (a ValueError, alike on every local rank) or a missing
    extra reported as one ``error:`` line on stderr and exit status 2."""
    try:
        return run(args)
    except (ValueError, MissingExtra) as exc:  # a missing extra: one line naming it
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # local ranks (demo): bad input is a ValueError on every rank
        from apbv.distributed import RankFailure

        if not isinstance(exc, RankFailure):
            raise
        messages = {message for kind, message in exc.errors.values()}
        if any(kind != "ValueError" for kind, _ in exc.errors.values()) or len(messages) != 1:
            raise
        print(f"error: {messages.pop()}", file=sys.stderr)
        return 2
