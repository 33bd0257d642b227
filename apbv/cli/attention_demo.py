"""``apbv attention-demo``: the attention op alone on CPU ranks, checked against exact attention
(:mod:`apbv.cli.demo_attention`)."""

from __future__ import annotations

import argparse
from typing import Any

from apbv.cli.common import add_plan_args


def register(sub: Any) -> None:
    attn = sub.add_parser("attention-demo", help="the attention op alone on CPU ranks vs exact")
    add_plan_args(attn, context_len=8192, world_size=2)
    attn.add_argument("--heads", type=int, default=8)
    attn.add_argument("--kv-heads", type=int, default=2)
    attn.add_argument("--head-dim", type=int, default=64)
    attn.add_argument("--seed", type=int, default=0)
    attn.add_argument("--json", action="store_true", help="also print one JSON line")
    attn.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from apbv.cli.demo_attention import DemoConfig, run_demo

    cfg = DemoConfig(
        world_size=args.world_size, context_len=args.context_len, query_len=args.query_len,
        heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        anchor_len=args.anchor_len, passing_len=args.passing_len, seed=args.seed,
    )
    cfg.plan()  # validate before starting any rank
    return 0 if run_demo(cfg, as_json=args.json) else 1
