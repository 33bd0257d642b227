"""``apbv eval merge --out MERGED SHARD_OUT...``: join the outputs of ``apbv eval --shard K/N``
(:mod:`apbv.eval.shards`) into one output and score it as one run."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("eval-merge", help="join the shard outputs of apbv eval --shard K/N "
                                          "and score them (also: apbv eval merge)")
    p.add_argument("--out", required=True, help="the merged JSONL (its _settings.json and "
                                                "_results.json are written beside it)")
    p.add_argument("shards", nargs="+", metavar="SHARD_OUT", help="the shards' JSONL outputs")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from apbv.eval.data import DEFAULT_MAX_NEW_TOKENS
    from apbv.eval.report import summary
    from apbv.eval.score import results_document
    from apbv.eval.shards import merge_shards

    settings, rows, total = merge_shards(args.out, args.shards)
    bench = settings["bench"]
    tokens = settings.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS[bench])
    generation = {"max_new_tokens": tokens, "temperature": 0, "do_sample": False}
    config = {"model": "apbv",
              "model_args": f"pretrained={settings['model.path']},mode={settings['mode']},"
                            f"world_size={settings['world_size']}",
              "batch_size": "1", "limit": settings["selection"]["limit"],
              "gen_kwargs": generation,
              "apbv": {"settings": settings, "merged_from": [str(s) for s in args.shards],
                       "output": str(args.out), "annotation": settings["annotation"]}}
    results = results_document(bench, rows, total=total, config=config, generation=generation,
                               compared=settings.get("compare") is not None)
    out = Path(args.out)
    path = out.with_name(f"{out.name.removesuffix('.jsonl')}_results.json")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    print(summary(results))
    print(f"merged {len(args.shards)} shard(s), {len(rows)} samples: {args.out}  "
          f"results: {path}")
    return 0
