"""TTFT on camera-like footage: the earlier PyAV reader against decoding only what is needed.

    python benchmarks/bench_ttft.py --footage camera                  # 10 min of 1080p, 2 ranks
    python benchmarks/bench_ttft.py --footage camera --footage-seconds 120

The footage (:func:`apbv.video.footage.write_camera_video`: 1080p, 30 fps, H.264, a keyframe
every 2 s, ``--footage-bframes`` B-frames) is written once into ``.cache/`` and reused; the
time it took is printed. One set of H gloo ranks (one thread each) loads the engine once and
answers every request twice per repeat, ``video.decode=all`` (the earlier reader: every coded
frame from the keyframe on, the last frame decoded at open, chunks of stacked frames resized)
and ``video.decode=needed`` (each frame resized as it is decoded), taking turns (in ABBA order
over the repeats) so a shared machine's drift hits both alike. Sampling: 2 fps capped by the
pixel budget's frame count (qwen-vl-utils' max_frames, 768), frames resized under
``video.max_pixels``.

Checked in the same run: every rank's sampled frames (a sha256 of its resized frames) and the
first tokens are identical in both variants. Reported per variant: every stage (slowest rank,
best of the repeats), the preprocess share of TTFT, coded frames decoded per rank, the CPU
seconds each rank's decoding and resizing thread used (``time.thread_time``: what a loaded
machine's waiting leaves out of the wall seconds), the ratios needed / all of both (and per
repeat, with their median), and for the needed variants the coded frames each rank walks and
the frame seconds the cost model's ``cpu`` preset predicts for them
(:func:`apbv.cost.predict.footage_frame_s`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import model_dir

from apbv.config import RuntimeConfig, load_config
from apbv.distributed import DistInfo, spawn_local
from apbv.timing import TTFT_STAGES as STAGES

VARIANTS = ("all", "needed")
"""``video.decode`` of the two variants: the earlier reader, then the new one."""

SNAPPED = "needed, snapped"
"""The third variant's name (``--footage-snap``): needed with ``video.snap_to_keyframes``."""

ALIGNED = "needed, keyframe split"
"""The variant with ``video.keyframe_split`` (``--footage-keyframe-split``): exact frames."""

QUESTION = "What moves across the scene?"


def camera_footage(cache: Path, seconds: float, bframes: int) -> tuple[Path, float]:
    """The benchmark's file under ``cache`` (written when missing) and the seconds writing
    it took (0.0 when reused)."""
    from apbv.video.footage import write_camera_video

    path = cache / f"camera_1080p30_{seconds:g}s_gop2_b{bframes}.mp4"
    if path.exists():
        return path, 0.0
    start = time.perf_counter()
    tmp = path.with_suffix(".part.mp4")
    write_camera_video(tmp, seconds=seconds, fps=30, width=1920, height=1080, codec="h264",
                       gop_seconds=2.0, bframes=bframes)
    tmp.rename(path)
    return path, time.perf_counter() - start


class _Probe:
    """Inside one rank: wraps :mod:`apbv.video.load`'s reader opening and frame decoding to
    record the coded frames decoded and a digest of the resized frames of each request."""

    def __init__(self) -> None:
        import apbv.video.load as load

        self.readers: list[Any] = []
        self.digest = hashlib.sha256()
        self.moved = 0
        self.cpu_s = 0.0
        opened, decoded = load._open, load._decode_resized

        def open_reader(*args: Any, **kwargs: Any) -> Any:
            reader = opened(*args, **kwargs)
            self.readers.append(reader)
            return reader

        def decode(*args: Any, **kwargs: Any) -> Any:
            self.moved = len(args[2].moved)  # (reader, indices, sampling, ...)
            start = time.thread_time()
            frames = decoded(*args, **kwargs)
            self.cpu_s += time.thread_time() - start
            self.digest.update(frames.contiguous().numpy().tobytes())
            return frames

        load._open, load._decode_resized = open_reader, decode

    def take(self) -> tuple[int, str, float]:
        """(coded frames decoded, sha256 of the frames, CPU seconds of decoding and resizing)
        since the last take."""
        count = sum(getattr(r, "frames_decoded", 0) for r in self.readers)
        digest, cpu_s = self.digest.hexdigest()[:16], self.cpu_s
        self.readers, self.digest, self.cpu_s = [], hashlib.sha256(), 0.0
        return count, digest, cpu_s


def variant_fields(snap: float | None, aligned: bool) -> dict[str, dict[str, Any]]:
    """The VideoSpec fields of each variant, by name."""
    variants: dict[str, dict[str, Any]] = {name: {"decode": name} for name in VARIANTS}
    if snap is not None:
        variants[SNAPPED] = {"decode": "needed", "snap_to_keyframes": snap}
    if aligned:
        variants[ALIGNED] = {"decode": "needed", "keyframe_split": True}
    return variants


def predicted_frame_s(cfg: RuntimeConfig, video: Path, fields: dict[str, Any],
                      world_size: int) -> list[tuple[int, float]]:
    """Per rank of a ``video.decode=needed`` variant: (coded frames walked, frame seconds
    the cost model's ``cpu`` preset predicts: :func:`apbv.cost.predict.footage_frame_s`) for
    the sampling and frame split the engine uses."""
    from apbv import cost
    from apbv.cost.predict import footage_frame_s
    from apbv.video import plan_sampling, probe
    from apbv.video.gop import frame_split, rank_walks

    spec = dataclasses.replace(cfg.video.spec(str(video)), **fields)
    meta = probe(spec)
    keys = meta.keyframes
    sampling = plan_sampling(spec, meta)
    ranges = frame_split(sampling, world_size)
    pixels = meta.width * meta.height
    return [(walk.frames, footage_frame_s(cost.CPU, walk.frames, 2 * (end - start), pixels,
                                          walk.intervals))
            for (start, end), walk in zip(ranges, rank_walks(keys, sampling.indices, ranges))]


def _rank_job(info: DistInfo, cfg: RuntimeConfig, warmup: str, video: str,
              repeats: int, snap: float | None, aligned: bool) -> dict[str, Any]:
    from apbv.engine.engine import Engine

    probe = _Probe()
    engine = Engine(cfg, info)
    variants = variant_fields(snap, aligned)

    def answer(path: str, decode: str) -> Any:
        request = engine.request(path, QUESTION, mode="spava", max_new_tokens=2)
        request = dataclasses.replace(
            request, video=dataclasses.replace(request.video, **variants[decode]))
        return engine.generate(request)

    for decode in variants:
        answer(warmup, decode)
        probe.take()
    out: dict[str, Any] = {}
    for repeat in range(repeats):
        order = list(variants) if repeat % 2 == 0 else list(variants)[::-1]
        for decode in order:  # ABBA: a steady drift in the machine's load hits both alike
            result = answer(video, decode)
            decoded, digest, cpu_s = probe.take()
            row = out.setdefault(decode, {"stage_best_s": {}, "digests": set(),
                                          "tokens": set(), "best": None, "cpu_s": cpu_s,
                                          "runs": []})
            row["cpu_s"] = min(row["cpu_s"], cpu_s)
            row["runs"].append((result.seconds.get("preprocess", 0.0), cpu_s))
            row["decoded"], row["frames"] = decoded, result.frames
            row["moved"] = probe.moved
            row["digests"].add(digest)
            row["tokens"].add(tuple(result.token_ids))
            if row["best"] is None or result.ttft_s < row["best"]["ttft_s"]:
                row["best"] = {"ttft_s": result.ttft_s, "seconds": result.seconds,
                               "prompt_tokens": result.context_len + result.query_len}
            stages = row["stage_best_s"]
            for stage, seconds in result.seconds.items():
                stages[stage] = min(seconds, stages.get(stage, seconds))
            if info.rank == 0:
                print(f"  [footage] decode={decode}: TTFT {result.ttft_s:.2f} s, preprocess "
                      f"{result.seconds.get('preprocess', 0.0):.2f} s", file=sys.stderr,
                      flush=True)
    return out


def run_footage(args: argparse.Namespace) -> str:
    """The side-by-side run; returns the markdown report (also written to ``args.out``.md,
    default ``benchmarks/results/ttft_camera_latest.md``: the curated
    ``ttft_camera_cpu.md`` and the synthetic runs' ``ttft_cpu.md`` are left alone)."""
    cache = Path(".cache")
    cache.mkdir(exist_ok=True)
    video, wrote = camera_footage(cache, args.footage_seconds, args.footage_bframes)
    if wrote:
        print(f"[footage] wrote {video} in {wrote:.0f} s", file=sys.stderr, flush=True)
    warmup, _ = camera_footage(cache, 4.0, args.footage_bframes)
    with tempfile.TemporaryDirectory(prefix="apbv-bench-") as tmp:
        model = model_dir(args, Path(tmp))
        cfg = load_config(args.config, [
            f"model.path={model!r}", "video.fps=2.0", "video.backend=pyav",
            f"video.max_pixels={args.footage_max_pixels}", "video.min_pixels=3136",
            "cache.vision_gb=0", f"parallel.timeout_s={args.timeout}"])
        per_rank = spawn_local(_rank_job, args.world_size,
                               (cfg, str(warmup), str(video), args.repeats,
                                args.footage_snap, args.footage_keyframe_split),
                               threads_per_rank=1, timeout_s=7200,
                               collective_timeout_s=args.timeout)
        predicted = {name: predicted_frame_s(cfg, video, fields, args.world_size)
                     for name, fields in variant_fields(args.footage_snap,
                                                        args.footage_keyframe_split).items()
                     if fields["decode"] == "needed"}
    report = _report(per_rank, video, wrote, args, predicted)
    stem = Path(args.out or "benchmarks/results/ttft_camera_latest")
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(report)
    return report


def _report(per_rank: list[dict[str, Any]], video: Path, wrote: float,
            args: argparse.Namespace, predicted: dict[str, list[tuple[int, float]]]) -> str:
    rank0 = per_rank[0]
    lines = [f"Footage: `{video.name}` ({args.footage_seconds:g} s of 1920x1080 at 30 fps, "
             f"H.264, keyframe every 2 s, {args.footage_bframes} B-frames; "
             + (f"written in {wrote:.0f} s" if wrote else "reused from .cache/")
             + f"), {args.world_size} CPU ranks x 1 thread, video.backend=pyav, "
             f"{rank0['all']['frames']} frames sampled, best of {args.repeats}.", "",
             "| video.decode | prompt tokens | TTFT s | " + " | ".join(STAGES)
             + " | preprocess share | coded frames decoded per rank | frame CPU s per rank "
             "| coded frames walked per rank | predicted frame s per rank |",
             "|---|---:|---:|" + "---:|" * len(STAGES) + "---:|---|---|---|---|"]
    for decode in rank0:
        row = rank0[decode]
        best = row["stage_best_s"]
        ttft = row["best"]["ttft_s"]
        decoded = ", ".join(str(r[decode]["decoded"]) for r in per_rank)
        cpu = ", ".join(f"{r[decode]['cpu_s']:.1f}" for r in per_rank)
        model = predicted.get(decode)
        walked = "-" if model is None else ", ".join(str(w) for w, _ in model)
        guess = "-" if model is None else ", ".join(f"{s:.1f}" for _, s in model)
        lines.append(f"| {decode} | {row['best']['prompt_tokens']} | {ttft:.2f} | "
                     + " | ".join(f"{best.get(s, 0.0):.2f}" for s in STAGES)
                     + f" | {best.get('preprocess', 0.0) / ttft:.0%} | {decoded} | {cpu} "
                     f"| {walked} | {guess} |")
    ratio = rank0["needed"]["stage_best_s"]["preprocess"] / \
        rank0["all"]["stage_best_s"]["preprocess"]
    frames_same = all(len(r["all"]["digests"] | r["needed"]["digests"]) == 1 for r in per_rank)
    tokens_same = len(rank0["all"]["tokens"] | rank0["needed"]["tokens"]) == 1
    cpu_ratio = max(r["needed"]["cpu_s"] for r in per_rank) / \
        max(r["all"]["cpu_s"] for r in per_rank)
    lines += ["", f"preprocess needed / all: **{ratio:.2f}x** (wall), **{cpu_ratio:.2f}x** "
              f"(frame CPU seconds, slowest rank); sampled frames identical on every rank: "
              f"{'yes' if frames_same else 'NO'}; tokens identical: "
              f"{'yes' if tokens_same else 'NO'}."]
    if args.repeats > 1:
        wall, cpu = paired_ratios(per_rank, "needed", "all")
        lines.append(f"Per repeat (the two requests of a repeat back to back, in ABBA order): "
                     f"wall {', '.join(f'{r:.2f}' for r in wall)} (median "
                     f"{statistics.median(wall):.2f}x), frame CPU seconds "
                     f"{', '.join(f'{r:.2f}' for r in cpu)} (median "
                     f"{statistics.median(cpu):.2f}x).")
    for name, model in predicted.items():
        slowest = max(r[name]["cpu_s"] for r in per_rank)
        lines.append(f"Cost model (`cpu` preset, `footage_frame_s`) for {name}: "
                     f"{max(s for _, s in model):.1f} s predicted against {slowest:.1f} frame "
                     f"CPU s measured on the slowest rank ({max(s for _, s in model) / slowest:.2f}"
                     f"x) and {rank0[name]['stage_best_s']['preprocess']:.1f} s of preprocess "
                     "(wall).")
    if ALIGNED in rank0:
        same = rank0[ALIGNED]["tokens"] == rank0["all"]["tokens"]
        lines.append(f"With video.keyframe_split: tokens equal to the balanced split's: "
                     f"{'yes' if same else 'NO'}.")
    if SNAPPED in rank0:
        snapped = rank0[SNAPPED]["stage_best_s"]["preprocess"] / \
            rank0["all"]["stage_best_s"]["preprocess"]
        lines.append(f"With video.snap_to_keyframes={args.footage_snap:g} s (approximate: "
                     f"{rank0[SNAPPED]['moved']} of the sampled frames moved to a keyframe): "
                     f"preprocess / all **{snapped:.2f}x**; tokens equal to the exact ones: "
                     f"{'yes' if rank0[SNAPPED]['tokens'] == rank0['all']['tokens'] else 'no'}.")
    return "\n".join(lines) + "\n"


def paired_ratios(per_rank: list[dict[str, Any]], new: str,
                  old: str) -> tuple[list[float], list[float]]:
    """Per repeat, ``new`` / ``old``: the preprocess stage's wall seconds (the slowest rank's,
    as every rank reports it) and the slowest rank's frame CPU seconds."""
    runs = range(len(per_rank[0][old]["runs"]))
    wall = [per_rank[0][new]["runs"][i][0] / per_rank[0][old]["runs"][i][0] for i in runs]
    cpu = [max(r[new]["runs"][i][1] for r in per_rank)
           / max(r[old]["runs"][i][1] for r in per_rank) for i in runs]
    return wall, cpu


def add_footage_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--footage", choices=("camera",),
                        help="camera-like footage: the earlier reader against video.decode="
                             "needed, side by side (see benchmarks/footage_ttft.py)")
    parser.add_argument("--footage-seconds", type=float, default=600.0)
    parser.add_argument("--footage-bframes", type=int, default=3)
    parser.add_argument("--footage-max-pixels", type=int, default=16 * 28 * 28,
                        help="video.max_pixels of the footage run")
    parser.add_argument("--footage-snap", type=float,
                        help="also a variant with video.snap_to_keyframes=SECONDS")
    parser.add_argument("--footage-keyframe-split", action="store_true",
                        help="also a variant with video.keyframe_split=true")
