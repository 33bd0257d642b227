"""``apbv generate``: answer one question about one video (run under torchrun)."""

from __future__ import annotations

import argparse
import builtins
import functools
import json
import sys
from typing import TYPE_CHECKING, Any

from apbv.cli.common import add_config_args, config_from_args, distributed, require_model

if TYPE_CHECKING:
    from apbv.engine.request import Result


def register(sub: Any) -> None:
    gen = sub.add_parser("generate", help="answer a question about a video (run under torchrun)")
    add_config_args(gen, default_preset=None)
    gen.add_argument("--video", required=True, help="video file")
    gen.add_argument("--question", required=True, help="question about the video")
    gen.add_argument("--system", metavar="TEXT",
                     help="the chat template's system turn (plain text; default: the "
                          "template's own)")
    gen.add_argument("--choices", action="append", metavar="TEXT",
                     help="a closed-vocabulary answer; repeat for each (2 .. 64): every choice "
                          "is scored by its exact log-probability and the likeliest is the "
                          "answer, nothing is generated")
    gen.add_argument("--json", action="store_true", help="also print one JSON line")
    gen.set_defaults(run=run)


def print_result(result: Result, *, as_json: bool) -> None:
    """The answer, its TTFT and stage times, and the bytes moved, as rank 0 prints them (on
    stderr with ``as_json``: stdout then holds only the JSON)."""
    print = functools.partial(builtins.print, file=sys.stderr if as_json else sys.stdout)
    print(f"answer: {result.answer!r}")
    for choice in result.choices or ():
        print(f"  choice {choice['text']!r}: p={choice['prob']:.4f} "
              f"(logprob {choice['logprob']:.4f}, {choice['tokens']} tokens)")
    stages = "  ".join(f"{k} {v:.3f}s" for k, v in result.seconds.items())
    print(f"TTFT {result.ttft_s:.3f} s on {result.world_size} rank(s), mode {result.mode} "
          f"({result.context_len}+{result.query_len} prompt tokens, {result.frames} frames)")
    print(f"stages (max over ranks): {stages}")
    print(f"video embeddings moved: {result.embedding_bytes} bytes "
          f"(an all-gather would move {result.allgather_bytes})")
    if as_json:
        builtins.print(json.dumps(result.to_json()))


def run(args: argparse.Namespace) -> int:
    from apbv.engine.engine import Engine
    from apbv.engine.request import Request

    cfg = config_from_args(args)
    require_model(cfg)
    request = Request.from_config(cfg, args.video, args.question,  # checked before any work
                                  choices=args.choices, system=args.system)
    with distributed(cfg) as info:
        result = Engine(cfg, info).generate(request)
        if info.rank == 0:
            print_result(result, as_json=args.json)
    return 0
