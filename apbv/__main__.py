"""Command line of apbv: the apbv command, or python -m apbv (the same).

    python -m apbv demo                                  # the whole pipeline on 2 CPU ranks
    torchrun --nproc_per_node 8 -m apbv generate --config qwen2_5_vl_7b_8gpu \\
        --model /ckpt/Qwen2.5-VL-7B-Instruct --video clip.mp4 --question "What happens?"
    python -m apbv plan --context-len 32768 --query-len 64 --world-size 8 [--model DIR]
    python -m apbv make-tiny-model --out .cache/tiny-qwen2.5-vl
    python -m apbv make-test-video --out .cache/demo.mp4 --seconds 40
    python -m apbv attention-demo                        # the attention op alone vs exact
    torchrun --nproc_per_node 8 -m apbv eval --bench longvideobench --data /data/LongVideoBench \
        --model /ckpt/Qwen2.5-VL-7B-Instruct --mode spava [--limit N] [--compare exact]
        [--groups G] [--shard K/N]
    python -m apbv eval merge --out merged.jsonl shard1.jsonl shard2.jsonl
    python -m apbv make-eval-fixtures --bench vnbench --out .cache/vnbench-fixture
    python -m apbv serve --world-size 2 --media-root ~/videos    # OpenAI-style HTTP server
    torchrun --nproc_per_node 2 -m apbv watch --config tiny_cpu --source rtsp://cam/live \
        --ask-every 10 --question "Is anyone at the door?"     # or questions on stdin
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from apbv import package_version
from apbv.cli import COMMANDS
from apbv.cli.common import run_reporting_errors


def _prog() -> str:
    """The command's name as run: ``apbv`` (the console script) or ``python -m apbv``."""
    return "apbv" if os.path.basename(sys.argv[0] or "") == "apbv" else "python -m apbv"


def main(argv: list[str] | None = None) -> int:
    """The ``apbv`` console script and ``python -m apbv``: parse ``argv`` (default
    ``sys.argv[1:]``) and run the subcommand; returns the exit status (2: bad input or a
    missing extra, as one ``error:`` line).

    Building the parser imports nothing heavy (torch, transformers, ray, fastapi): each
    subcommand (a module of :mod:`apbv.cli`) imports what it needs when it runs, so ``--help``
    and ``--version`` are quick.
    """
    parser = argparse.ArgumentParser(prog=_prog(), description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--version", action="version", version=f"apbv {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"apbv.cli.{name}").register(sub)

    given = list(argv if argv is not None else sys.argv[1:])
    if given[:2] == ["eval", "merge"]:  # apbv eval merge: the eval-merge subcommand
        given = ["eval-merge", *given[2:]]
    args = parser.parse_args(given)
    args.argv = list(argv if argv is not None else sys.argv[1:])  # recorded by train-tiny
    return run_reporting_errors(args.run, args)


if __name__ == "__main__":
    sys.exit(main())
