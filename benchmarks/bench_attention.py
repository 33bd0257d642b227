"""One attention layer on CPU gloo ranks: spava vs exact vs single-process full attention.

    python benchmarks/bench_attention.py                       # H=2, N = 4k..32k
    python benchmarks/bench_attention.py --context-lens 32768 --repeats 5

The H ranks each get 1 thread; full attention runs in this process with H threads, so every
method uses the same total threads. A layer is timed between barriers and the slowest rank
decides; the best of ``--repeats`` timed calls after ``--warmup`` untimed ones is reported. The
"predicted" columns are the ratios of counted attention FLOPs (apbv.cost) under the same thread
budgets. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import asdict, dataclass

import torch

from apbv import cost
from apbv.attention import apbv_attention, attention
from apbv.distributed import DistInfo, spawn_local
from apbv.plan import make_plan
from apbv.timing import best_time


@dataclass(frozen=True)
class Setup:
    context_lens: tuple[int, ...]
    query_len: int
    world_size: int
    heads: int
    kv_heads: int
    head_dim: int
    warmup: int
    repeats: int


def _inputs(setup: Setup, length: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, length, setup.heads, setup.head_dim, generator=g)
    k = torch.randn(1, length, setup.kv_heads, setup.head_dim, generator=g)
    v = torch.randn(1, length, setup.kv_heads, setup.head_dim, generator=g)
    return q, k, v


def _rank_times(info: DistInfo, setup: Setup) -> dict[int, dict[str, float]]:
    times: dict[int, dict[str, float]] = {}
    for n in setup.context_lens:
        plan = make_plan(n, setup.query_len, info.world_size)
        q, k, v = _inputs(setup, plan.local_len(info.rank), seed=info.rank)
        times[n] = {
            mode: best_time(
                lambda q=q, k=k, v=v, p=p: apbv_attention(q, k, v, p),
                setup.repeats,
                warmup=setup.warmup,
            )
            for mode, p in (("spava", plan), ("exact", plan.exact()))
        }
        if info.rank == 0:
            print(f"  N={n}: ranks done", file=sys.stderr, flush=True)
    return times


def run(setup: Setup) -> list[dict[str, float]]:
    print(f"timing {setup.world_size} gloo ranks x 1 thread ...", file=sys.stderr, flush=True)
    rank_times = spawn_local(_rank_times, setup.world_size, (setup,), timeout_s=3600)[0]
    torch.set_num_threads(setup.world_size)
    rows = []
    for n in setup.context_lens:
        plan = make_plan(n, setup.query_len, setup.world_size)
        q, k, v = _inputs(setup, plan.total_len, seed=0)
        full = best_time(lambda q=q, k=k, v=v: attention(q, k, v, causal=True), setup.repeats,
                         warmup=setup.warmup)
        spava_pairs = max(cost.rank_pairs(plan, r) for r in range(plan.world_size))
        exact_pairs = max(cost.rank_pairs(plan.exact(), r) for r in range(plan.world_size))
        # Full attention has world_size threads, each rank one: divide its work accordingly.
        full_per_thread = cost.full_pairs(plan) / setup.world_size
        spava, exact = rank_times[n]["spava"], rank_times[n]["exact"]
        rows.append(
            dict(
                context_len=n,
                anchor_len=plan.anchor_len,
                passing_len=plan.passing_len,
                spava_s=spava,
                exact_s=exact,
                full_s=full,
                spava_over_exact=spava / exact,
                spava_over_full=spava / full,
                predicted_spava_over_exact=spava_pairs / exact_pairs,
                predicted_spava_over_full=spava_pairs / full_per_thread,
            )
        )
        print(f"  N={n}: full attention done", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context-lens", default="4096,8192,16384,32768",
                        help="comma-separated context lengths N")
    parser.add_argument("--query-len", type=int, default=64)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    try:
        lens = tuple(int(x) for x in args.context_lens.split(","))
    except ValueError:
        parser.error(f"--context-lens must be comma-separated integers, got {args.context_lens!r}")
    setup = Setup(lens, args.query_len, args.world_size, args.heads, args.kv_heads,
                  args.head_dim, args.warmup, args.repeats)
    rows = run(setup)
    print(f"H={setup.world_size} Hq={setup.heads} Hkv={setup.kv_heads} D={setup.head_dim} "
          f"Q={setup.query_len} fp32, best of {setup.repeats}; ratios measured (predicted)")
    print(f"{'N':>7} {'A':>5} {'P':>5} {'spava s':>9} {'exact s':>9} {'full s':>9} "
          f"{'spava/exact':>16} {'spava/full':>16}")
    for r in rows:
        print(f"{r['context_len']:>7} {r['anchor_len']:>5} {r['passing_len']:>5} "
              f"{r['spava_s']:>9.3f} {r['exact_s']:>9.3f} {r['full_s']:>9.3f} "
              f"{r['spava_over_exact']:>8.3f} ({r['predicted_spava_over_exact']:.3f}) "
              f"{r['spava_over_full']:>8.3f} ({r['predicted_spava_over_full']:.3f})")
    print(json.dumps({
        "benchmark": "bench_attention",
        "setup": asdict(setup),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "rows": rows,
    }))


if __name__ == "__main__":
    main()
