"""``apbv serve``: the OpenAI-compatible HTTP server over H Ray rank actors
(:mod:`apbv.serve.main`)."""

from __future__ import annotations

import argparse
from typing import Any

from apbv.cli.common import add_config_args, config_from_args


def register(sub: Any) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server over H Ray rank actors")
    add_config_args(serve, default_preset="tiny_cpu")
    from apbv.serve.main import add_serve_args

    add_serve_args(serve)
    serve.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from apbv.serve.main import run_server

    return run_server(config_from_args(args), args)
