"""One rank's vision tower, each change of the new path added in turn, timed side by side.

    .venv/bin/python benchmarks/bench_vision.py --size medium --temporal-patches 64

Runs the tower of a random ``--size`` model (or ``--model``) on one rank's share of the
bench_ttft case (256 frames at 448x448 on 2 ranks: 64 temporal patches of 32 x 32 patches), in
one process with ``--threads`` threads (1: one of 2 ranks on 2 cores), for five variants:

- ``old``: transformers' stock tower (``vision.attention=per_window``, ``patch_embed=conv``,
  ``rotary=stock``, the whole video in one call: ``chunk_rows=0``);
- ``+ grouped, linear``: the windows grouped by size, the patch embedding as one product;
- ``+ contiguous rotary``: the q/k rotary on contiguous copies;
- ``+ chunks = new``: whole temporal patches, ``--chunk-rows`` patch rows per call;
- ``chunks only``: the stock tower in chunks.

The variants take turns, ``--repeats`` rounds, so drift on a shared machine hits them alike;
the median of each and its ratio to ``old`` are reported, with each variant's max abs
difference to ``old`` (all are exact: the linear patch embedding sums in another order, so
fp32 rounding differs; the other changes gave 0 in the tests). Writes ``--out`` .md/.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import STOCK_TOWER, add_model_args, model_dir

VARIANTS = {  # name: config overrides of the vision settings (the rest: the defaults)
    "old": STOCK_TOWER,
    "+ grouped, linear": ("vision.rotary=stock", "vision.chunk_rows=0"),
    "+ contiguous rotary": ("vision.chunk_rows=0",),
    "+ chunks = new": (),
    "chunks only": ("vision.attention=per_window", "vision.patch_embed=conv",
                    "vision.rotary=stock"),  # the stock tower on the chunks
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--temporal-patches", type=int, default=64)
    parser.add_argument("--grid", default="32x32", help="patches per temporal patch, HxW")
    parser.add_argument("--chunk-rows", type=int, default=None,
                        help="patch rows per call of the chunked variants (default: the CPU's)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/vision_cpu")
    args = parser.parse_args(argv)
    if args.temporal_patches < 1 or args.repeats < 1 or args.threads < 1:
        parser.error("--temporal-patches, --repeats and --threads must be >= 1")
    try:
        h, w = (int(v) for v in args.grid.lower().split("x"))
    except ValueError:
        parser.error(f"--grid must be HxW patches, e.g. 32x32; got {args.grid!r}")
    if h % 2 or w % 2 or h < 2 or w < 2:
        parser.error(f"--grid sides must be even and >= 2 (2x2 patches merge), got {args.grid}")

    from apbv.config import load_config
    from apbv.model import qwen2_5_vl

    torch.set_num_threads(args.threads)
    chunk = qwen2_5_vl.CPU_CHUNK_ROWS if args.chunk_rows is None else args.chunk_rows
    with tempfile.TemporaryDirectory() as tmp:
        qwen = qwen2_5_vl.load(model_dir(args, Path(tmp)), device=torch.device("cpu"),
                               dtype=torch.float32)
    grid = (args.temporal_patches, h, w)
    pixels = torch.randn(args.temporal_patches * h * w, 3 * 2 * 14 * 14,
                         generator=torch.Generator().manual_seed(0))

    settings = {name: load_config("tiny_cpu", [f"vision.chunk_rows={chunk}", *overrides]).vision
                for name, overrides in VARIANTS.items()}  # later overrides win

    def run(name: str) -> tuple[float, torch.Tensor]:
        qwen.set_vision(settings[name])
        start = time.perf_counter()
        out = qwen.vision_tower(pixels, grid)
        return time.perf_counter() - start, out

    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with torch.inference_mode():
        reference = run("old")[1]
        error = {name: (run(name)[1] - reference).abs().max().item() for name in VARIANTS}
        scale = reference.abs().max().item()
        for i in range(args.repeats):
            for name in VARIANTS:
                seconds[name].append(run(name)[0])
            print(f"[bench_vision] round {i + 1}/{args.repeats}: "
                  + ", ".join(f"{n} {s[-1]:.3f} s" for n, s in seconds.items()), flush=True)
    old = statistics.median(seconds["old"])
    rows = [{"variant": name, "median_s": statistics.median(s), "min_s": min(s),
             "over_old": statistics.median(s) / old, "max_abs_diff": error[name]}
            for name, s in seconds.items()]
    table = "\n".join(
        [f"One rank's vision tower: {grid[0]} temporal patches of {h}x{w} patches, "
         f"{args.threads} thread(s), chunks of {chunk} patch rows, median of {args.repeats}; "
         f"outputs up to {scale:.3g} in absolute value.",
         "", "| variant | median s | min s | / old | max abs diff to old |",
         "|---|---:|---:|---:|---:|"]
        + [f"| {r['variant']} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['over_old']:.2f} | "
           f"{r['max_abs_diff']:.2g} |" for r in rows])
    stem = Path(args.out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(table + "\n")
    meta = {"torch": torch.__version__, "machine": platform.machine(), "grid": list(grid),
            "threads": args.threads, "chunk_rows": chunk, "model": args.model or args.size,
            "output_scale": scale}
    stem.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print(table)


if __name__ == "__main__":
    main()
