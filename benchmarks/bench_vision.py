"""One rank's vision tower, each change of the new path added in turn, timed side by side.

    .venv/bin/python benchmarks/bench_vision.py --size medium --temporal-patches 64

Runs the tower of a random ``--size`` model (or ``--model``) on one rank's share of the
bench_ttft case (256 frames at 448x448 on 2 ranks: 64 temporal patches of 32 x 32 patches), in
one process with ``--threads`` threads (1: one of 2 ranks on 2 cores), for six variants, on
the patch rows of random frames:

- ``old``: transformers' stock tower (``vision.attention=per_window``, ``patch_embed=conv``,
  ``rotary=stock``, the whole video in one call: ``chunk_rows=0``) on the processor's rows;
- ``+ grouped, linear``: the windows grouped by size, the patch embedding as one product;
- ``+ fused rotary``: the q/k rotary with q and k in one set of passes;
- ``+ chunks``: whole temporal patches, ``--chunk-rows`` patch rows per call;
- ``+ pixel levels = new``: the tower takes int8 pixel levels, the normalisation folded into
  the patch embedding (one integer product, or the fp32 one where the CPU's integer product is
  slow; ``vision.preprocess=levels``);
- ``chunks only``: the stock tower in chunks.

The variants take turns, ``--repeats`` rounds, so drift on a shared machine hits them alike;
the median of each and its ratio to ``old`` are reported, with each variant's max abs
difference to ``old`` (all are exact: the linear patch embedding sums in another order, so
fp32 rounding differs; the other changes change at most the rounding of products over
fewer rows). Writes ``--out`` .md/.json.

``--parts`` then times where ``old`` and ``new`` spend their time, part by part (forward
hooks on the tower's modules and a wrapper around SDPA; of ``--repeats`` runs, the one with
the median total), and sets the attention kernels, arithmetic both towers do alike, against
half of ``old``: what is left of that half is the budget of everything else in ``new``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from common import STOCK_TOWER, add_model_args, model_dir

VARIANTS = {  # name: config overrides of the vision settings (the rest: the defaults)
    "old": STOCK_TOWER,
    "+ grouped, linear": ("vision.rotary=stock", "vision.chunk_rows=0",
                          "vision.preprocess=fused"),
    "+ fused rotary": ("vision.chunk_rows=0", "vision.preprocess=fused"),
    "+ chunks": ("vision.preprocess=fused",),
    "+ pixel levels = new": (),
    "chunks only": ("vision.attention=per_window", "vision.patch_embed=conv",
                    "vision.rotary=stock"),  # the stock tower on the chunks
}
NEW = "+ pixel levels = new"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--temporal-patches", type=int, default=64)
    parser.add_argument("--grid", default="32x32", help="patches per temporal patch, HxW")
    parser.add_argument("--chunk-rows", type=int, default=None,
                        help="patch rows per call of the chunked variants (default: the CPU's)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--parts", action="store_true",
                        help="also time old and new part by part (forward hooks)")
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
    from apbv.model.common import tower
    from apbv.model.qwen2_5_vl import adapter as qwen2_5_vl

    torch.set_num_threads(args.threads)
    chunk = tower.CPU_CHUNK_ROWS if args.chunk_rows is None else args.chunk_rows
    with tempfile.TemporaryDirectory() as tmp:
        model = qwen2_5_vl.load(model_dir(args, Path(tmp)), device=torch.device("cpu"),
                                dtype=torch.float32)
    grid = (args.temporal_patches, h, w)
    frames = torch.randint(0, 256, (2 * args.temporal_patches, 3, 14 * h, 14 * w),
                           dtype=torch.uint8, generator=torch.Generator().manual_seed(0))

    settings = {name: load_config("tiny_cpu", [f"vision.chunk_rows={chunk}", *overrides]).vision
                for name, overrides in VARIANTS.items()}  # later overrides win
    pixels, by_dtype = {}, {}
    for name, vision in settings.items():  # what each variant's tower takes: rows or levels
        model.set_vision(vision)
        rows = model.tower_rows(frames)[0]
        pixels[name] = by_dtype.setdefault(rows.dtype, rows)
    del frames, rows

    def run(name: str) -> tuple[float, torch.Tensor]:
        model.set_vision(settings[name])
        start = time.perf_counter()
        out = model.vision_tower(pixels[name], grid)
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
    report: dict[str, Any] = {"rows": rows}
    if args.parts:
        parts = {name: _parts(model, pixels[name], grid, settings[name], args.repeats)
                 for name in ("old", NEW)}
        report["parts_ms"] = parts
        table += "\n\n" + _parts_table(parts["old"], parts[NEW], args.repeats)
    stem = Path(args.out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(table + "\n")
    meta = {"torch": torch.__version__, "machine": platform.machine(), "grid": list(grid),
            "threads": args.threads, "chunk_rows": chunk, "model": args.model or args.size,
            "output_scale": scale}
    stem.with_suffix(".json").write_text(json.dumps({**meta, **report}, indent=1) + "\n")
    print(table)


PARTS = ("patch embedding", "attention kernels (SDPA)", "qkv and output projections",
         "rest of attention (rotary, reshapes, copies)", "MLPs", "norms", "merger",
         "rest of the tower (positions, windows, gathers, residuals)",
         "outside the tower (chunk slices, concatenation)")
PATCH, SDPA, PROJ, ATTN_REST, MLP, NORM, MERGER, TOWER_REST, OUTSIDE = PARTS


@contextlib.contextmanager
def _timed_parts(visual: torch.nn.Module) -> Iterator[dict[str, float]]:
    """Seconds per part of the tower's forward while inside (hooks on its modules and a
    wrapper around SDPA, which both towers call through ``torch.nn.functional``)."""
    spent: dict[str, float] = collections.defaultdict(float)
    started: dict[int, float] = {}
    handles = []

    def hook(module: torch.nn.Module, part: str) -> None:
        def before(*_: Any) -> None:
            started[id(module)] = time.perf_counter()

        def after(*_: Any) -> None:
            spent[part] += time.perf_counter() - started[id(module)]
        handles.extend([module.register_forward_pre_hook(before),
                        module.register_forward_hook(after)])

    hook(visual, "tower")
    hook(visual.patch_embed, PATCH)
    hook(visual.merger, MERGER)
    for block in visual.blocks:
        for module, part in ((block.norm1, NORM), (block.norm2, NORM), (block.mlp, MLP),
                             (block.attn, "attention"), (block.attn.qkv, PROJ),
                             (block.attn.proj, PROJ)):
            hook(module, part)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def timed_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
        start = time.perf_counter()
        out = sdpa(*args, **kwargs)
        spent[SDPA] += time.perf_counter() - start
        return out

    torch.nn.functional.scaled_dot_product_attention = timed_sdpa
    try:
        yield spent
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
        for handle in handles:
            handle.remove()


def _parts(model: Any, pixels: torch.Tensor, grid: tuple[int, int, int], vision: Any,
           repeats: int) -> dict[str, float]:
    """Milliseconds per part (:data:`PARTS`, and ``total``) of the run with the median total
    of ``repeats`` tower runs with the ``vision`` settings (one run's parts add up to it)."""
    model.set_vision(vision)
    runs = []
    with torch.inference_mode():
        model.vision_tower(pixels, grid)  # warm-up, untimed
        for _ in range(repeats):
            with _timed_parts(model.model.model.visual) as spent:
                start = time.perf_counter()
                model.vision_tower(pixels, grid)
                total = time.perf_counter() - start
            hooked = {part: spent[part] for part in (PATCH, SDPA, PROJ, MLP, NORM, MERGER)}
            runs.append({
                **hooked,
                ATTN_REST: spent["attention"] - hooked[SDPA] - hooked[PROJ],
                TOWER_REST: spent["tower"] - spent["attention"] - hooked[PATCH] - hooked[MLP]
                - hooked[NORM] - hooked[MERGER],
                OUTSIDE: total - spent["tower"],
                "total": total})
    median = sorted(runs, key=lambda r: r["total"])[len(runs) // 2]
    return {part: 1e3 * seconds for part, seconds in median.items()}


def _parts_table(old: dict[str, float], new: dict[str, float], repeats: int) -> str:
    """The parts side by side, and new's attention kernels (the same arithmetic in both
    towers) against half of ``old``."""
    lines = [f"Where the time goes (ms; the run of median total out of {repeats}, timed with "
             "hooks: the totals run a little above the untimed ones):", "",
             "| part | old | new | new / old |", "|---|---:|---:|---:|"]
    lines += [f"| {p} | {old[p]:.1f} | {new[p]:.1f} | {new[p] / old[p]:.2f} |"
              if old[p] > 0 else f"| {p} | {old[p]:.1f} | {new[p]:.1f} | - |"
              for p in (*PARTS, "total")]
    half, shared = old["total"] / 2, new[SDPA]
    rest = new["total"] - shared
    lines += ["", f"Half of old is {half:.1f} ms. New spends {shared:.1f} ms in the attention "
              f"kernels (the arithmetic both do alike), which leaves {half - shared:.1f} ms "
              f"for everything else; everything else takes {rest:.1f} ms "
              f"({rest / max(half - shared, 1e-9):.2f}x that budget)."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
