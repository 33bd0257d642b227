"""Command line of apbv.

    python -m apbv demo                                  # APB-V on 2 CPU ranks vs exact attention
    python -m apbv demo --world-size 3 --context-len 16384 --json
    python -m apbv plan --context-len 32768 --query-len 64 --world-size 8
"""

from __future__ import annotations

import argparse
import sys

from apbv.demo import DemoConfig, run_demo


def _add_plan_args(p: argparse.ArgumentParser, *, context_len: int, world_size: int) -> None:
    p.add_argument("--context-len", type=int, default=context_len, help="N, tokens before the query")
    p.add_argument("--query-len", type=int, default=64, help="Q, tokens of the query")
    p.add_argument("--world-size", type=int, default=world_size, help="H, number of ranks")
    p.add_argument("--anchor-len", type=int, default=None, help="A (default about N/64)")
    p.add_argument("--passing-len", type=int, default=None, help="P (default about N/128)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m apbv", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run APB-V attention on local CPU ranks and check it")
    _add_plan_args(demo, context_len=8192, world_size=2)
    demo.add_argument("--heads", type=int, default=8)
    demo.add_argument("--kv-heads", type=int, default=2)
    demo.add_argument("--head-dim", type=int, default=64)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true", help="also print one JSON line")

    plan = sub.add_parser("plan", help="print the layout without running anything")
    _add_plan_args(plan, context_len=32768, world_size=8)

    args = parser.parse_args(argv)
    try:
        if args.command == "plan":
            from apbv.plan import make_plan

            print(make_plan(args.context_len, args.query_len, args.world_size,
                            anchor_len=args.anchor_len, passing_len=args.passing_len).describe())
            return 0
        cfg = DemoConfig(
            world_size=args.world_size, context_len=args.context_len, query_len=args.query_len,
            heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
            anchor_len=args.anchor_len, passing_len=args.passing_len, seed=args.seed,
        )
        cfg.plan()  # validate before starting any rank
        return 0 if run_demo(cfg, as_json=args.json) else 1
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
