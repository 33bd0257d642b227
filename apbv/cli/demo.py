"""``apbv demo``: the whole pipeline on local CPU ranks, spava next to exact
(:mod:`apbv.cli.demo_pipeline`)."""

from __future__ import annotations

import argparse
from typing import Any

from apbv.cli.common import add_config_args, config_from_args


def register(sub: Any) -> None:
    demo = sub.add_parser("demo", help="the whole pipeline on local CPU ranks, spava vs exact")
    add_config_args(demo, default_preset="tiny_cpu")
    demo.add_argument("--world-size", type=int, default=2)
    demo.add_argument("--video", help="video file (default: a generated needle video, asked of "
                                      "the trained tiny model)")
    demo.add_argument("--question", help="question (default: the needle video's, or 'What "
                                         "colour is the square at the end?' for --video)")
    demo.add_argument("--json", action="store_true", help="also print one JSON line")
    demo.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from apbv.cli.demo_pipeline import run_pipeline_demo

    model_given = args.model is not None or any(
        s.strip().startswith("model.path") for s in args.set)
    run_pipeline_demo(config_from_args(args), world_size=args.world_size,
                      video=args.video, question=args.question, as_json=args.json,
                      model_given=model_given)
    return 0
