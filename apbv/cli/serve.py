"""``apbv serve``: the OpenAI-compatible HTTP server over H Ray rank actors
(:mod:`apbv.serve.main`). Its flags are settings that a TOML file (``--config-file``) and
``APBV_SERVE_*`` environment variables may give too (:mod:`apbv.cli.serve_settings`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from apbv.cli.common import add_config_args, config_from_args


def add_args(p: argparse.ArgumentParser) -> None:
    """Every flag of ``apbv serve`` (each one a setting, but ``--config-file`` and
    ``--print-config``)."""
    add_config_args(p, default_preset="tiny_cpu")
    from apbv.serve.main import add_serve_args

    add_serve_args(p)
    p.add_argument("--config-file", metavar="TOML",
                   help="serve settings file: keys are the flags' names with underscores "
                        "(max_queue = 4); command line > APBV_SERVE_* environment "
                        "(APBV_SERVE_MAX_QUEUE=4) > this file > defaults (default: env "
                        "APBV_SERVE_CONFIG_FILE, else none)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved settings as a --config-file, each with where its "
                        "value came from, and exit (nothing starts)")


def register(sub: Any) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server over H Ray rank actors")
    add_args(serve)
    serve.set_defaults(run=run)


def parser() -> argparse.ArgumentParser:
    """A parser of ``apbv serve``'s flags alone (the settings are read from it)."""
    p = argparse.ArgumentParser(prog="apbv serve")
    add_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    from apbv.cli.serve_settings import render_toml, resolve

    flags = parser()
    assert "serve" in args.argv, "apbv.__main__.main records the command line in args.argv"
    argv = args.argv[args.argv.index("serve") + 1:]  # what the command line itself gives
    args = resolve(flags, argv, args)
    if args.print_config:
        sys.stdout.write(render_toml(flags, args))
        return 0
    outside = sorted(k for k, where in args.setting_sources.items()
                     if where not in ("command line", "default"))
    args.settings_note = "settings from outside the command line: " + ", ".join(
        f"{k} ({args.setting_sources[k]})" for k in outside) if outside else None
    from apbv.serve.main import run_server

    return run_server(config_from_args(args), args)
