"""``apbv batch``: an OpenAI batch file of chat requests answered with one model load
(:mod:`apbv.cli.batch_run`)."""

from __future__ import annotations

import argparse
from typing import Any

from apbv.cli.common import add_config_args, add_group_args, config_from_args


def register(sub: Any) -> None:
    p = sub.add_parser("batch", help="answer an OpenAI batch file of chat requests with "
                                     "one model load (resumable; run under torchrun)")
    add_config_args(p, default_preset="tiny_cpu")
    p.add_argument("-i", "--input", required=True, help="OpenAI batch file (JSONL)")
    p.add_argument("-o", "--output", required=True, help="results (JSONL); resumed if it exists")
    p.add_argument("--media-root", action="append", default=[], metavar="DIR",
                   help="directories file:// videos may be under (default: the input file's)")
    p.add_argument("--no-retry-failed", dest="retry_failed", action="store_false",
                   help="keep rows of an earlier run that failed with a server error (5xx) "
                        "instead of running them again (4xx rows are always kept)")
    add_group_args(p, "requests")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from apbv.cli.batch_run import main

    return main(args, config_from_args(args))
