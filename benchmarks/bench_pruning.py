"""Temporal pruning on static-camera footage: kept fraction and seconds, side by side, with
the cost model's prediction at the measured keep rate.

    python benchmarks/bench_pruning.py                  # medium random model, 256 frames
    python benchmarks/bench_pruning.py --size tiny --frames 128 --thresholds 2,4,8 \
        --out benchmarks/results/pruning_cpu.md

The camera (decoded frames, no file): :func:`apbv.video.footage.camera_frame`'s scene (a
textured wall in YUV, converted to RGB here) at ``--height`` x ``--width``, sampled at 2 fps,
with Gaussian sensor noise of ``--noise`` grey levels (standard deviation) on every pixel of
every frame and a slow lighting drift (``--drift`` levels brighter over the clip). Nothing
moves except during one event of ``--event-seconds`` at a random time, when the footage's
moving objects (a car, a person: ``--objects``) cross the frame. The footage's timestamp
overlay (a block whose brightness steps every second) is frozen unless ``--clock``: a running
clock changes a cell of every temporal patch, so every patch is kept at any threshold below its
step; its keep rate is printed either way (the signatures alone, no model run).

One engine per rank (``spava``; ``--size medium``: the random model where prefill, not decode,
dominates, as in ``bench_ttft.py``); the thresholds (0 first: unpruned) take turns, one
warm-up round and ``--repeats`` timed ones; printed per threshold: the video tokens kept (of
the unpruned prompt's), whether the event's patches were kept, and the median seconds of
preprocess (no decoding here: the signatures and the agreement), vision, prefill, vision +
prefill and TTFT with the ratio to unpruned in the same run; beside them the cost model's
ratios (``--hardware``, the checkpoint's sizes) at the measured keep rate
(:class:`apbv.cost.Workload` ``keep_rate``): vision + prefill, and TTFT without preprocess
(the model prices decoding frames, which this benchmark does not do). A threshold's units: the
largest change of a merged patch's mean level (0-255) since the last kept temporal patch
(``apbv/video/prune.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import add_model_args, model_dir, print_table  # noqa: E402

from apbv.config import load_config  # noqa: E402
from apbv.distributed import DistInfo, spawn_local  # noqa: E402
from apbv.video import DecodedVideo  # noqa: E402
from apbv.video.prune import keep_mask, signatures  # noqa: E402

FPS = 2.0
SOURCE_FPS = 30.0
"""The footage's frame rate: the objects move as in a 30 fps camera sampled at :data:`FPS`."""
QUESTION = "What appeared in the scene?"


def _rgb(planes: np.ndarray, height: int, width: int) -> np.ndarray:
    """float32 (3, H, W) RGB of yuv420p planes (BT.601, full range)."""
    y = planes[:height].astype(np.float32)
    u = planes[height:height + height // 4].reshape(height // 2, width // 2)
    v = planes[height + height // 4:].reshape(height // 2, width // 2)
    u, v = (np.repeat(np.repeat(c.astype(np.float32) - 128, 2, 0), 2, 1) for c in (u, v))
    return np.stack([y + 1.402 * v, y - 0.344136 * u - 0.714136 * v, y + 1.772 * u])


def camera(frames: int, height: int, width: int, *, noise: float, drift: float, objects: int,
           event_seconds: float, clock: bool, seed: int) -> tuple[DecodedVideo, range]:
    """The static camera of the module docstring and the sampled frames its event spans."""
    from apbv.video.footage import camera_frame

    g = torch.Generator().manual_seed(seed)
    length = min(frames, max(1, round(event_seconds * FPS)))
    start = int(torch.randint(frames // 4, max(frames // 4 + 1, frames - length), (1,),
                              generator=g))
    event = range(start, start + length)
    step = SOURCE_FPS / FPS
    out = torch.empty(frames, 3, height, width, dtype=torch.uint8)
    for i in range(frames):
        planes = camera_frame(round(i * step), fps=SOURCE_FPS if clock else float("inf"),
                              width=width, height=height, seed=seed,
                              objects=objects if i in event else 0)
        frame = torch.from_numpy(_rgb(planes, height, width)) + drift * i / frames
        frame += torch.randn(frame.shape, generator=g) * noise
        out[i] = frame.round().clamp(0, 255).to(torch.uint8)
    return DecodedVideo(out, FPS), event


def _job(info: DistInfo, model: str, video: DecodedVideo, thresholds: list[float],
         repeats: int) -> dict[float, dict[str, Any]]:
    from apbv.engine.engine import Engine
    from apbv.engine.request import Request

    side = video.frames.shape[-1] * video.frames.shape[-2]
    engine = Engine(load_config("tiny_cpu", [f"model.path={model!r}",
                                             f"video.max_pixels={side}"]), info)
    out: dict[float, dict[str, Any]] = {t: {"seconds": [], "ttft": []} for t in thresholds}
    for run in range(repeats + 1):  # round 0: the warm-up; the thresholds take turns
        for threshold in thresholds:
            result = engine.generate(Request(video=video, question=QUESTION, mode="spava",
                                             static_threshold=threshold, max_new_tokens=1))
            out[threshold].update(context_len=result.context_len, query_len=result.query_len)
            if run:
                out[threshold]["seconds"].append(result.seconds)
                out[threshold]["ttft"].append(result.ttft_s)
    return out


def _predicted(model: str, hw_name: str, res: dict[float, dict[str, Any]], frames: int,
               grid: tuple[int, int], ranks: int, keep: dict[float, float],
               ) -> dict[float, tuple[float, float]]:
    """Per threshold: the cost model's (vision + prefill, TTFT without preprocess) ratio to
    unpruned at the measured keep rate."""
    from apbv import cost
    from apbv.modes import get_mode

    dims, hw = cost.checkpoint_dims(model), cost.hardware(hw_name)
    work = cost.Workload.of(dims, context_len=res[0.0]["context_len"],
                            query_len=res[0.0]["query_len"], world_size=ranks, frames=frames,
                            grid=grid)
    whole = cost.estimate(get_mode("spava"), dims, work, hw)

    def parts(p: cost.Prediction) -> tuple[float, float]:
        return p.seconds["vision"] + p.seconds["prefill"], p.device_ttft_s

    base = parts(whole)
    out = {}
    for t, k in keep.items():
        pruned = parts(cost.estimate(get_mode("spava"), dims,
                                     dataclasses.replace(work, keep_rate=k),
                                     hw)) if k < 1 else base
        out[t] = (pruned[0] / base[0], pruned[1] / base[1])
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p)
    p.set_defaults(size="medium")
    p.add_argument("--frames", type=int, default=256)
    p.add_argument("--height", type=int, default=448)
    p.add_argument("--width", type=int, default=448)
    p.add_argument("--noise", type=float, default=3.0, help="sensor noise, grey levels (std)")
    p.add_argument("--drift", type=float, default=6.0, help="lighting drift over the clip")
    p.add_argument("--objects", type=int, default=2, help="objects crossing in the event")
    p.add_argument("--event-seconds", type=float, default=16.0)
    p.add_argument("--clock", action="store_true", help="a running timestamp overlay")
    p.add_argument("--thresholds", default="4")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--hardware", default="cpu", help="the cost model's hardware (or JSON)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="markdown file to write (default: stdout only)")
    args = p.parse_args(argv)
    thresholds = [0.0] + [float(t) for t in args.thresholds.split(",")]
    shape = dict(noise=args.noise, drift=args.drift, objects=args.objects,
                 event_seconds=args.event_seconds, seed=args.seed)
    video, event = camera(args.frames, args.height, args.width, clock=args.clock, **shape)
    cells_hw = (args.height // 28, args.width // 28)
    other = camera(args.frames, args.height, args.width, clock=not args.clock, **shape)[0]
    load_before, started = os.getloadavg(), time.strftime("%H:%M", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(args, Path(tmp))
        res = spawn_local(_job, args.ranks, (model, video, thresholds, args.repeats),
                          timeout_s=3600, collective_timeout_s=600)[0]
        tokens = cells_hw[0] * cells_hw[1]
        video_tokens = args.frames // 2 * tokens
        text = res[0.0]["context_len"] - video_tokens
        keep = {t: (res[t]["context_len"] - text) / video_tokens for t in thresholds}
        predicted = _predicted(model, args.hardware, res, args.frames, cells_hw, args.ranks,
                               keep)
    load_after = os.getloadavg()

    def median(threshold: float, stage: str) -> float:
        if stage == "ttft":
            return statistics.median(res[threshold]["ttft"])
        if stage == "vision+prefill":
            return statistics.median(s.get("vision", 0.0) + s.get("prefill", 0.0)
                                     for s in res[threshold]["seconds"])
        if stage == "ttft-preprocess":
            return statistics.median(t - s.get("preprocess", 0.0) for t, s in
                                     zip(res[threshold]["ttft"], res[threshold]["seconds"]))
        return statistics.median(s.get(stage, 0.0) for s in res[threshold]["seconds"])

    def ratio(t: float, stage: str) -> float:
        return median(t, stage) / max(median(0.0, stage), 1e-9)

    stages = ("preprocess", "vision", "prefill", "vision+prefill", "ttft")
    model_name = args.model or f"random {args.size}"
    lines = [
        f"# Temporal pruning on static-camera footage ({args.ranks} CPU ranks, {model_name} "
        f"model)", "",
        f"`python benchmarks/bench_pruning.py --size {args.size} --frames {args.frames} "
        f"--thresholds {args.thresholds} --repeats {args.repeats}`, {started} UTC; "
        f"{args.frames} frames {args.width}x{args.height} at {FPS:g} fps, noise std "
        f"{args.noise:g}, drift {args.drift:g}, {args.objects} objects crossing in frames "
        f"{event.start}-{event.stop - 1}, timestamp overlay "
        f"{'running' if args.clock else 'frozen'}; {args.ranks} CPU ranks, spava, {model_name}"
        f" model, median of {args.repeats}; load average (1/5/15 min) "
        f"{'/'.join(f'{x:.1f}' for x in load_before)} before, "
        f"{'/'.join(f'{x:.1f}' for x in load_after)} after", "",
        f"| threshold | video tokens kept | event kept | "
        f"{' | '.join(f'{s} s (x unpruned)' for s in stages)} | predicted vision+prefill x "
        f"| predicted / measured | TTFT - preprocess x (predicted) |",
        "|---" * (6 + len(stages)) + "|"]
    for t in thresholds:
        mask = [True] * (args.frames // 2) if t == 0 else \
            keep_mask(signatures(video.frames, 2, cells_hw), t)
        assert abs(sum(mask) / len(mask) - keep[t]) < 1e-9, (t, sum(mask), keep[t])  # one rule
        seen = any(mask[f // 2] for f in event)
        cells = [f"{median(t, s):.3f} ({ratio(t, s):.2f}x)" for s in stages]
        vp, nopre = predicted[t]
        lines.append(f"| {t:g} | {keep[t]:.3f} | {'yes' if seen else 'NO'} | "
                     f"{' | '.join(cells)} | {vp:.2f}x | {vp / ratio(t, 'vision+prefill'):.2f} | "
                     f"{ratio(t, 'ttft-preprocess'):.2f}x ({nopre:.2f}x) |")
    clock = "without" if args.clock else "with"
    kept_other = ", ".join(f"{t:g}: {sum(m) / len(m):.3f}" for t in thresholds[1:]
                           for m in [keep_mask(signatures(other.frames, 2, cells_hw), t)])
    lines += ["", f"The same footage {clock} a running timestamp overlay keeps (signatures "
                  f"only): {kept_other}."]
    print_table(lines, args.out)


if __name__ == "__main__":
    main()
