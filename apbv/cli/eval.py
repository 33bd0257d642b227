"""``apbv eval``: LongVideoBench or VNBench accuracy (run under torchrun, resumable), and
``apbv make-eval-fixtures``: a small synthetic dataset in a benchmark's format."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from apbv.cli.common import (
    add_config_args,
    add_group_args,
    config_from_args,
    distributed,
    require_model,
)
from apbv.eval.data import BENCHMARKS


def register(sub: Any) -> None:
    ev = sub.add_parser("eval", help="LongVideoBench or VNBench accuracy (run under torchrun); "
                                     "resumable")
    add_config_args(ev, default_preset=None)
    ev.add_argument("--bench", required=True, choices=BENCHMARKS)
    ev.add_argument("--data", required=True, help="the benchmark's directory (annotation file "
                                                   "and videos)")
    ev.add_argument("--annotation", help="annotation file in --data or a path (default: "
                                         "lvb_val.json, VNBench-main-4try.json)")
    ev.add_argument("--out", help="JSONL of per-sample results, resumed if it exists (default: "
                                  "eval_results/BENCH_MODE.jsonl); results: OUT_results.json")
    ev.add_argument("--limit", type=int, help="only the first N samples")
    ev.add_argument("--where", action="append", default=[], metavar="FIELD=VALUE",
                    help="only samples whose annotation field equals VALUE, e.g. "
                         "--where duration_group=600")
    ev.add_argument("--compare", choices=("exact",),
                    help="also answer every sample with exact attention; report the agreement")
    ev.add_argument("--no-retry-failed", dest="retry_failed", action="store_false",
                    help="keep the samples that failed in an earlier run on --out as they are "
                         "(default: run them again)")
    ev.add_argument("--skip-missing", action="store_true",
                    help="start even if video files are missing: record their samples as "
                         "failed (default: refuse, listing the missing files)")
    ev.add_argument("--shard", metavar="K/N",
                    help="run only part K of N of the samples (default: from "
                         "SLURM_ARRAY_TASK_ID/_COUNT in a job array, else all); join the "
                         "parts with apbv eval merge")
    add_group_args(ev, "samples")
    ev.set_defaults(run=run)

    fixtures = sub.add_parser("make-eval-fixtures",
                              help="write a small synthetic dataset in a benchmark's format")
    fixtures.add_argument("--bench", required=True, choices=BENCHMARKS)
    fixtures.add_argument("--out", required=True, help="directory to write")
    fixtures.add_argument("--count", type=int, help="LongVideoBench questions (4; needles 24) "
                                                    "or VNBench questions per type (1; "
                                                    "needles 6)")
    fixtures.add_argument("--videos", choices=("squares", "needles"), default="squares",
                          help="moving squares with square needles (default), or the trained "
                               "tiny model's needle videos and questions (apbv/assets/"
                               "needle-tiny answers them with the option letter)")
    fixtures.add_argument("--seed", type=int, default=0)
    fixtures.set_defaults(run=run_fixtures)


def run(args: argparse.Namespace) -> int:
    from apbv.distributed import rank_groups
    from apbv.engine.engine import Engine
    from apbv.eval.data import parse_where
    from apbv.eval.harness import EvalSpec, run_eval, summary
    from apbv.eval.shards import parse_shard
    from apbv.model.checkpoint import read_config

    cfg = config_from_args(args)
    require_model(cfg)
    mode = cfg.attention.mode
    spec = EvalSpec(bench=args.bench, data_dir=args.data, mode=mode,
                    out=args.out or f"eval_results/{args.bench}_{mode}.jsonl",
                    annotation=args.annotation, limit=args.limit, where=parse_where(args.where),
                    compare=args.compare, max_new_tokens=args.max_new_tokens,
                    retry_failed=args.retry_failed, skip_missing=args.skip_missing,
                    model_type=read_config(cfg.model.path).get("model_type"),
                    groups=args.groups, shard=parse_shard(args.shard))
    failed = 0
    with distributed(cfg) as info:
        _, group = rank_groups(info, spec.groups)  # a G that does not divide the world: here
        results = run_eval(spec, cfg, lambda: Engine(cfg, group), progress=sys.stderr)
        if results is not None:
            failed = results["apbv"]["scores"]["errors"]
            print(summary(results))
            print(f"results: {spec.results_path}  samples: {spec.out}")
    return 1 if failed and args.fail_on_error else 0


def run_fixtures(args: argparse.Namespace) -> int:
    from apbv.synthetic.eval_fixtures import make_eval_fixtures

    print(make_eval_fixtures(args.bench, args.out, count=args.count, seed=args.seed,
                             videos=args.videos))
    return 0
