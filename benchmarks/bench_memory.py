"""Preflight memory estimate (apbv.cost.request_memory) against the measured peak, on 1 CPU rank.

    python benchmarks/bench_memory.py                       # tiny and medium, about 8k and 32k
    python benchmarks/bench_memory.py --sizes medium --frames 256 --out memory.md

For each random model (``python -m apbv make-tiny-model --size``) and each synthetic video
(``python -m apbv make-test-video``-style, 448x448 at 2 fps: 256 tokens per 2 frames, so 64 and
256 frames give prompts of about 8k and 32k tokens), one request runs in a fresh subprocess on
one CPU rank with one thread (apbv.engine.engine.Engine, spava mode, one new token), after a
warm-up request on a 4-frame video (the engine is long-lived; on CPU the checkpoint is memory-
mapped and its pages are only resident once used). Measured: the process's peak resident set
(``ru_maxrss``) minus its resident set just before the engine loads the checkpoint (imports
done), i.e. a baseline-subtracted RSS peak. Estimated:
``request_memory`` for the same plan, video grid and fp32, reserve 1. Output: a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

SIDE = 448  # pixels: (448 / 28)^2 = 256 LLM tokens per 2 frames


def _rss_bytes() -> int:
    """The current resident set (Linux /proc), or the peak so far where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child(model: str, warm: str, video: str) -> None:
    """A warm-up request on a short video, then the measured one, in this (fresh) process;
    prints one JSON line."""
    import torch

    from apbv.config import load_config
    from apbv.distributed import DistInfo
    from apbv.engine.engine import Engine

    torch.set_num_threads(1)
    cfg = load_config("tiny_cpu", [f"model.path={model!r}", "video.fps=2.0",
                                   f"video.max_pixels={SIDE * SIDE}", "video.min_pixels=3136"])
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                    backend=None)
    baseline = _rss_bytes()
    engine = Engine(cfg, info)
    question = "What colour is the square at the end?"
    engine.generate(warm, question, mode="spava", max_new_tokens=1)  # the weights paged in
    result = engine.generate(video, question, mode="spava", max_new_tokens=1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"baseline": baseline, "peak": peak, "frames": result.frames,
                      "context_len": result.context_len, "query_len": result.query_len,
                      "anchor_len": result.anchor_len, "passing_len": result.passing_len,
                      "ttft_s": result.ttft_s}))


def _estimate(model: str, row: dict) -> object:
    from apbv import cost
    from apbv.modes import get_mode

    dims = cost.model_dims(cost.read_config(model))
    plan = get_mode("spava").plan(row["context_len"], row["query_len"], 1,
                                  anchor_len=row["anchor_len"], passing_len=row["passing_len"])
    patches, rows, cols = cost.video_grid(row["frames"], SIDE, SIDE, max_pixels=SIDE * SIDE,
                                          min_pixels=3136)
    merge = dims.spatial_merge_size
    return cost.request_memory(dims, plan, patches=patches, grid_hw=(rows * merge, cols * merge),
                               dtype_bytes=4, reserve_tokens=1, rank=0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,medium")
    parser.add_argument("--frames", default="64,256", help="frames per video, 2 fps, 448x448")
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "WARM", "VIDEO"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(*args.child)
        return
    from apbv.model.tiny import write_tiny_checkpoint
    from apbv.synthetic import write_test_video

    lines = [("Peak memory of one request on 1 CPU rank (fp32, 1 thread, spava, 1 new token, "
              "after a 4-frame warm-up request): measured = ru_maxrss minus the resident set "
              "just before the checkpoint loads (baseline-subtracted RSS peak); estimated = "
              "apbv.cost.request_memory."), "",
             ("| model | frames | prompt tokens | measured MiB | estimated MiB | est / measured "
              "| peak phase | largest parts (MiB) |"),
             "|---|---:|---:|---:|---:|---:|---|---|"]
    with tempfile.TemporaryDirectory(prefix="apbv-mem-") as tmp:
        root = Path(tmp)
        warm = root / "warm.mp4"
        write_test_video(warm, num_frames=4, fps=2.0, width=SIDE, height=SIDE, seed=4)
        for size in args.sizes.split(","):
            model = str(write_tiny_checkpoint(root / size, size=size))
            for n in (int(x) for x in args.frames.split(",")):
                video = root / f"v{n}.mp4"
                if not video.exists():
                    write_test_video(video, num_frames=n, fps=2.0, width=SIDE, height=SIDE,
                                     seed=n)
                out = subprocess.run([sys.executable, __file__, "--child", model, str(warm),
                                      str(video)],
                                     check=True, capture_output=True, text=True)
                row = json.loads(out.stdout.strip().splitlines()[-1])
                est = _estimate(model, row)
                measured = row["peak"] - row["baseline"]
                phase = est.phases[est.peak_phase]
                largest = sorted(phase, key=lambda p: -est.parts[p])[:4]
                parts = ", ".join(f"{p} {est.parts[p] / 2**20:.0f}" for p in largest)
                line = (f"| {size} | {row['frames']} | {row['context_len'] + row['query_len']} "
                        f"| {measured / 2**20:.0f} | {est.total / 2**20:.0f} "
                        f"| {est.total / measured:.2f} | {est.peak_phase} | {parts} |")
                print(line, file=sys.stderr, flush=True)
                lines.append(line)
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
