"""End-to-end TTFT of every mode on the same videos, measured side by side in one run.

    python benchmarks/bench_ttft.py --size tiny                  # tiny random model, 4k..32k tokens
    python benchmarks/bench_ttft.py --size medium --frames 64,128 --modes spava,zigzag_ring,full
    python benchmarks/bench_ttft.py --model /ckpt/Qwen2.5-VL-7B-Instruct ...   # a real checkpoint
    python benchmarks/bench_ttft.py --size medium --frames 256 --modes spava,zigzag_ring,full \
        --old-modes spava --pipelined-modes spava   # spava also on the old path, and pipelined

For each mode one set of ranks is started (H gloo ranks with one thread each; ``full`` is one
process with H threads: the same total threads), the engine is loaded once, one untimed
request per variant warms it up, and then every video is answered ``--repeats`` times; the best
TTFT is kept (the table's stages are that run's; the side-by-side summary takes each stage's
best). Every method uses the same sampler, the same timer (a device sync closes each stage) and
reports the slowest rank. Each mode's first token is compared with exact attention's. Peak RSS
is per request (the process's peak is reset before each one, where Linux allows it) and the
largest over the ranks.

``--old-modes`` also runs those modes on the old vision and preprocessing path
(``vision.attention=per_window``: one SDPA call per window; ``vision.patch_embed=conv``: the
stock Conv3d; ``vision.rotary=stock``: the rotary on strided q/k; ``vision.chunk_rows=0``: the
tower on the whole video at once; ``vision.preprocess=processor``: the HF video processor), as
rows of variant ``old``; the summary prints the vision and preprocess stages old over new.
``--pipelined-modes`` runs those modes with ``vision.pipeline=true`` (decoding, patch rows and
tower chunk by chunk inside each rank: the decoding moves into the vision stage), as rows of
variant ``pipelined``; the summary compares preprocess + vision with the new path's. A mode's
variants run on the same ranks and take turns within every repeat (``Engine.set_vision``
switches the path between requests), so drift on a shared machine hits them alike. Ratios to
full and zigzag_ring compare rows of one variant.

Videos: synthetic, ``--frames`` frames at 2 fps for each ``--resolution`` (frames are sampled
whole, so a WxH video gives (W/28)*(H/28) tokens per 2 frames). Output: JSON lines
(``--out``), a markdown table and a PNG plot of TTFT and speedup against prompt tokens.
``--footage camera``: 1080p camera-like footage instead, the earlier PyAV reader against
``video.decode=needed`` side by side (``benchmarks/footage_ttft.py``; ``--out``: its .md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from common import STOCK_TOWER, add_model_args, model_dir, pyplot, save_figure
from footage_ttft import add_footage_args, run_footage

from apbv.config import RuntimeConfig, VisionConfig, load_config
from apbv.distributed import DistInfo, spawn_local
from apbv.modes import MODE_NAMES
from apbv.timing import TTFT_STAGES as STAGES

OLD_PATH = (*STOCK_TOWER, "vision.preprocess=processor")
"""The overrides of the ``old`` variant: the stock vision tower and the HF processor."""


def _reset_peak_rss() -> None:
    """Start this process's peak RSS afresh (Linux: VmHWM, through /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # elsewhere the peak stays the process's
        pass


def _peak_rss_mib() -> float:
    """Peak RSS since :func:`_reset_peak_rss` (VmHWM), else the process's (ru_maxrss)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rank_job(info: DistInfo, cfg: RuntimeConfig, visions: dict[str, VisionConfig], mode: str,
              videos: list[dict], repeats: int) -> list[dict]:
    """``mode`` on every video with each variant's vision settings (``visions``: variant ->
    settings), one engine: the variants take turns within each repeat, so a shared machine's
    drift hits them alike. Rows variant by variant, each the best TTFT of its repeats."""
    from apbv.engine.engine import Engine

    engine = Engine(cfg, info)
    question = "What colour is the square in the last second?"

    def answer(path: str, variant: str) -> Any:
        engine.set_vision(visions[variant])
        return engine.generate(engine.request(path, question, mode=mode, max_new_tokens=1))

    for variant in visions:
        answer(videos[0]["path"], variant)  # warm-up, each path once
    rows: dict[str, list[dict]] = {variant: [] for variant in visions}
    for video in videos:
        best, stage_best, peak = {}, {v: {} for v in visions}, dict.fromkeys(visions, 0.0)
        for _ in range(repeats):
            for variant in visions:
                _reset_peak_rss()
                result = answer(video["path"], variant)
                peak[variant] = max(peak[variant], _peak_rss_mib())
                if variant not in best or result.ttft_s < best[variant].ttft_s:
                    best[variant] = result
                stages = stage_best[variant]
                for stage, seconds in result.seconds.items():
                    stages[stage] = min(seconds, stages.get(stage, seconds))
        for variant, result in best.items():
            row = result.to_json()
            row.update(variant=variant, stage_best_s=stage_best[variant],
                       video={k: v for k, v in video.items() if k != "path"},
                       rss_peak_mib=peak[variant])
            rows[variant].append(row)
            if info.rank == 0:
                print(f"  {mode:>12} {variant:>9} {video['frames']:>4} frames "
                      f"{video['width']}x{video['height']}: "
                      f"{row['context_len'] + row['query_len']} tokens, TTFT "
                      f"{row['ttft_s']:.3f} s", file=sys.stderr, flush=True)
    return [row for variant_rows in rows.values() for row in variant_rows]


def _videos(root: Path, frames: list[int], resolutions: list[tuple[int, int]]) -> list[dict]:
    from apbv.synthetic.videos import write_test_video

    out = []
    for width, height in resolutions:
        for n in frames:
            path = root / f"v{n}_{width}x{height}.mp4"
            write_test_video(path, num_frames=n, fps=2.0, width=width, height=height, seed=n)
            out.append({"path": str(path), "frames": n, "width": width, "height": height})
    return out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="apbv-bench-") as tmp:
        root = Path(tmp)
        model = model_dir(args, root)
        resolutions = [tuple(int(x) for x in r.split("x")) for r in args.resolutions.split(",")]
        frames = [int(x) for x in args.frames.split(",")]
        videos = _videos(root, frames, resolutions)
        max_pixels = max(w * h for w, h in resolutions)
        base = [f"model.path={model!r}", "video.fps=2.0", f"video.max_pixels={max_pixels}",
                "video.min_pixels=3136", f"parallel.timeout_s={args.timeout}"]
        cfg = load_config(args.config, base)
        variants = {"new": (cfg.vision, args.modes),
                    "old": (load_config(args.config, [*base, *OLD_PATH]).vision, args.old_modes),
                    "pipelined": (load_config(args.config, [*base, "vision.pipeline=true"]).vision,
                                  args.pipelined_modes)}
        rows = []
        for mode in dict.fromkeys(args.modes + args.old_modes + args.pipelined_modes):
            visions = {name: vision for name, (vision, modes) in variants.items()
                       if mode in modes}
            world = 1 if mode == "full" else args.world_size
            threads = args.world_size if mode == "full" else 1
            print(f"[bench] {mode} ({', '.join(visions)}): {world} rank(s) x {threads} "
                  f"thread(s)", file=sys.stderr, flush=True)
            run_cfg = dataclasses.replace(cfg, vision=next(iter(visions.values())))
            per_rank = spawn_local(_rank_job, world,
                                   (run_cfg, visions, mode, videos, args.repeats),
                                   threads_per_rank=threads, timeout_s=7200,
                                   collective_timeout_s=args.timeout)
            for i, row in enumerate(per_rank[0]):
                row["rss_peak_mib_max"] = max(r[i]["rss_peak_mib"] for r in per_rank)
                rows.append(row)
    _compare_with_exact(rows)
    return rows


def _compare_with_exact(rows: list[dict]) -> None:
    """Add each row's first-token agreement with exact mode and its speedups."""
    def key(r: dict) -> tuple:
        v = r["video"]
        return v["frames"], v["width"], v["height"], r["variant"]

    by_mode = {(r["mode"], key(r)): r for r in rows}
    for r in rows:
        exact = by_mode.get(("exact", key(r)))
        r["first_token_agrees_with_exact"] = (
            None if exact is None else r["token_ids"][0] == exact["token_ids"][0])
        for base in ("full", "zigzag_ring"):
            other = by_mode.get((base, key(r)))
            r[f"ttft_over_{base}"] = None if other is None else r["ttft_s"] / other["ttft_s"]


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(rows: list[dict]) -> str:
    lines = ["| mode | variant | frames | size | prompt tokens | TTFT s | "
             + " | ".join(STAGES) + " | / full | / zigzag_ring | first token = exact | "
             "peak RSS MiB |",
             "|---|---|---:|---|---:|---:|" + "---:|" * len(STAGES) + "---:|---:|---|---:|"]
    for r in rows:
        v = r["video"]
        agree = {True: "yes", False: "no", None: "-"}[r["first_token_agrees_with_exact"]]
        lines.append(
            f"| {r['mode']} | {r.get('variant', 'new')} | {v['frames']} | "
            f"{v['width']}x{v['height']} | "
            f"{r['context_len'] + r['query_len']} | {r['ttft_s']:.3f} | "
            + " | ".join(f"{r['seconds'].get(s, 0.0):.3f}" for s in STAGES)
            + f" | {_ratio(r['ttft_over_full'])} | {_ratio(r['ttft_over_zigzag_ring'])} | {agree}"
            f" | {r['rss_peak_mib_max']:.0f} |")
    return "\n".join(lines)


def old_over_new(rows: list[dict]) -> str:
    """Per mode and video run in two variants: vision, preprocess and TTFT, old / new; and
    preprocess + vision (the pipeline moves the decoding into the vision stage) and TTFT,
    pipelined / new. Stages: each one's best over the repeats (a shared machine's noise
    mostly adds time); TTFT: the best run's."""
    new = {(r["mode"], r["video"]["frames"], r["video"]["width"], r["video"]["height"]): r
           for r in rows if r["variant"] == "new"}
    out = []
    for r in rows:
        v = r["video"]
        other = new.get((r["mode"], v["frames"], v["width"], v["height"]))
        if r["variant"] not in ("old", "pipelined") or other is None:
            continue
        mine, base = r["stage_best_s"], other["stage_best_s"]
        if r["variant"] == "old":
            parts = [f"{s} {mine[s]:.3f} -> {base[s]:.3f} s (new/old {base[s] / mine[s]:.2f})"
                     for s in ("preprocess", "vision")]
            ttft = f"TTFT {r['ttft_s']:.3f} -> {other['ttft_s']:.3f} s"
        else:
            both = [x["preprocess"] + x["vision"] for x in (base, mine)]
            parts = [f"preprocess + vision {both[0]:.3f} -> {both[1]:.3f} s pipelined "
                     f"(pipelined/new {both[1] / both[0]:.2f})"]
            ttft = f"TTFT {other['ttft_s']:.3f} -> {r['ttft_s']:.3f} s"
        out.append(f"{r['mode']} {v['frames']} frames {v['width']}x{v['height']}: "
                   + "; ".join(parts) + f"; {ttft}")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, variant in dict.fromkeys((r["mode"], r["variant"]) for r in rows):
        mine = sorted((r for r in rows if (r["mode"], r["variant"]) == (mode, variant)),
                      key=lambda r: r["context_len"] + r["query_len"])
        tokens = [r["context_len"] + r["query_len"] for r in mine]
        label = mode if variant == "new" else f"{mode} ({variant})"
        left.plot(tokens, [r["ttft_s"] for r in mine], marker="o", label=label)
        speedup = [1 / r["ttft_over_full"] for r in mine if r["ttft_over_full"]]
        if len(speedup) == len(mine) and mode != "full":
            right.plot(tokens, speedup, marker="o", label=label)
    left.set(xlabel="prompt tokens", ylabel="TTFT (s)", title="time to first token")
    right.set(xlabel="prompt tokens", ylabel="speedup over full", title="speedup over full")
    right.axhline(1.0, color="grey", linewidth=0.8)
    return save_figure(fig, path, styled=(left, right))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--config", default="tiny_cpu", help="config preset")
    parser.add_argument("--modes", default=",".join(MODE_NAMES))
    parser.add_argument("--old-modes", default="",
                        help="modes also run on the old vision/preprocess path (comma-separated)")
    parser.add_argument("--pipelined-modes", default="",
                        help="modes also run with vision.pipeline=true (comma-separated)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--frames", default="32,64,128,256", help="comma-separated")
    parser.add_argument("--resolutions", default="448x448", help="comma-separated WxH")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0, help="collective timeout (s)")
    parser.add_argument("--out", help="output stem: writes STEM.jsonl, STEM.md and STEM.png "
                        "(default benchmarks/results/ttft_cpu; with --footage STEM.md only, "
                        "default benchmarks/results/ttft_camera_latest)")
    add_footage_args(parser)
    args = parser.parse_args(argv)
    if args.footage:  # camera footage, the earlier reader against the new one
        print(run_footage(args))
        return
    args.out = args.out or "benchmarks/results/ttft_cpu"
    for name in ("modes", "old_modes", "pipelined_modes"):  # comma-separated -> a list
        setattr(args, name, [mode for mode in getattr(args, name).split(",") if mode])
    unknown = set(args.modes + args.old_modes + args.pipelined_modes) - set(MODE_NAMES)
    if unknown:
        parser.error(f"unknown mode(s) {sorted(unknown)}; allowed: {', '.join(MODE_NAMES)}")
    rows = run(args)
    stem = Path(args.out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "machine": platform.machine(),
            "ranks": args.world_size, "model": args.model or f"random {args.size}"}
    with open(stem.with_suffix(".jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps({**meta, **row}) + "\n")
    table = markdown(rows)
    side = old_over_new(rows)
    stem.with_suffix(".md").write_text(table + "\n" + (f"\n```\n{side}\n```\n" if side else ""))
    print(table)
    if side:
        print(side)
    plotted = plot(rows, stem.with_suffix(".png"))
    print(json.dumps({"benchmark": "bench_ttft", **meta, "rows": len(rows),
                      "jsonl": str(stem.with_suffix(".jsonl")),
                      "plot": str(stem.with_suffix(".png")) if plotted else None}))


if __name__ == "__main__":
    main()
