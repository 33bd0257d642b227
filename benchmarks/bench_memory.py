"""Preflight memory estimate (apbv.cost.request_memory) against the measured peak, on 1 CPU rank.

    python benchmarks/bench_memory.py                       # tiny and medium, about 8k and 32k
    python benchmarks/bench_memory.py --sizes medium --frames 256 --out memory.md
    python benchmarks/bench_memory.py --set vision.pipeline=true   # any config overrides

For each random model (``python -m apbv make-tiny-model --size``) and each synthetic video
(``python -m apbv make-test-video``-style, 448x448 at 2 fps: 256 tokens per 2 frames, so 64 and
256 frames give prompts of about 8k and 32k tokens), one request runs in a fresh subprocess on
one CPU rank with one thread (apbv.engine.engine.Engine, spava mode, one new token), after a
warm-up request on a 4-frame video (the engine is long-lived; on CPU the checkpoint is memory-
mapped and its pages are only resident once used). Measured: the process's peak resident set
(``ru_maxrss``) minus its resident set just before the engine loads the checkpoint (imports
done), i.e. a baseline-subtracted RSS peak. Estimated:
``request_memory`` for the same plan, video grid and fp32, reserve 1, with the engine's vision
settings (``Engine.memory_estimate``). Output: a markdown table.
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

from common import print_table

SIDE = 448  # pixels: (448 / 28)^2 = 256 LLM tokens per 2 frames


def _rss_bytes() -> int:
    """The current resident set (Linux /proc), or the peak so far where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child(model: str, warm: str, video: str, overrides: str) -> None:
    """A warm-up request on a short video, then the measured one, in this (fresh) process;
    prints one JSON line with the peak and the engine's own estimate for the request."""
    import torch

    from apbv import cost
    from apbv.config import load_config
    from apbv.distributed import DistInfo
    from apbv.engine.engine import Engine

    torch.set_num_threads(1)
    cfg = load_config("tiny_cpu", [f"model.path={model!r}", "video.fps=2.0",
                                   f"video.max_pixels={SIDE * SIDE}", "video.min_pixels=3136",
                                   *json.loads(overrides)])
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                    backend=None)
    baseline = _rss_bytes()
    engine = Engine(cfg, info)
    question = "What colour is the square at the end?"
    engine.generate(engine.request(warm, question, mode="spava", max_new_tokens=1))  # paged in
    request = engine.request(video, question, mode="spava", max_new_tokens=1)
    result = engine.generate(request)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    patches, rows, cols = cost.video_grid(result.frames, SIDE, SIDE, max_pixels=SIDE * SIDE,
                                          min_pixels=3136)
    merge = engine.model.spatial_merge_size
    est = engine.memory_estimate(request, result.context_len, result.query_len, (0, patches),
                                 (rows * merge, cols * merge), reserve=1)
    print(json.dumps({"baseline": baseline, "peak": peak, "frames": result.frames,
                      "context_len": result.context_len, "query_len": result.query_len,
                      "ttft_s": result.ttft_s, "estimate": est.total,
                      "peak_phase": est.peak_phase,
                      "phase_parts": {p: est.parts[p] for p in est.phases[est.peak_phase]}}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,medium")
    parser.add_argument("--frames", default="64,256", help="frames per video, 2 fps, 448x448")
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="config override for the measured engine (repeatable)")
    parser.add_argument("--child", nargs=4, metavar=("MODEL", "WARM", "VIDEO", "OVERRIDES"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(*args.child)
        return
    from apbv.model.qwen2_5_vl.tiny import write_tiny_checkpoint
    from apbv.synthetic.videos import write_test_video

    settings = f" with {', '.join(args.set)}" if args.set else ""
    lines = [(f"Peak memory of one request on 1 CPU rank (fp32, 1 thread, spava, 1 new token, "
              f"after a 4-frame warm-up request{settings}): measured = ru_maxrss minus the "
              f"resident set just before the checkpoint loads (baseline-subtracted RSS peak); "
              f"estimated = apbv.cost.request_memory (Engine.memory_estimate)."), "",
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
                                      str(video), json.dumps(args.set)],
                                     capture_output=True, text=True)
                if out.returncode != 0:
                    sys.exit(f"bench_memory: the measured run failed:\n{out.stderr[-3000:]}")
                row = json.loads(out.stdout.strip().splitlines()[-1])
                measured = row["peak"] - row["baseline"]
                phase = row["phase_parts"]
                largest = sorted(phase, key=lambda p: -phase[p])[:4]
                parts = ", ".join(f"{p} {phase[p] / 2**20:.0f}" for p in largest)
                line = (f"| {size} | {row['frames']} | {row['context_len'] + row['query_len']} "
                        f"| {measured / 2**20:.0f} | {row['estimate'] / 2**20:.0f} "
                        f"| {row['estimate'] / measured:.2f} | {row['peak_phase']} | {parts} |")
                print(line, file=sys.stderr, flush=True)
                lines.append(line)
    print_table(lines, args.out)


if __name__ == "__main__":
    main()
