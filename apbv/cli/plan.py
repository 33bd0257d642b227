"""``apbv plan``: the layout and memory of a plan without loading weights; with ``--hardware``,
the predicted TTFT of every mode (:mod:`apbv.cost`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING, Any

from apbv.cli.common import add_plan_args
from apbv.modes import MODE_NAMES

if TYPE_CHECKING:
    from apbv.cost import Prediction, Workload

DEFAULT_FRAME_SIDE = 448
"""``plan --frames`` without ``--height``/``--width``: square frames of this side (stated in
the output; a source's real size is better)."""


def register(sub: Any) -> None:
    plan = sub.add_parser("plan", help="print the layout and memory without loading weights; "
                                       "with --hardware, the predicted TTFT of every mode")
    add_plan_args(plan, context_len=32768, world_size=8)
    plan.add_argument("--model", help="checkpoint directory: read config.json for the memory "
                                      "estimate and the prediction (no weights are loaded)")
    plan.add_argument("--preset", help="model sizes for the prediction instead of --model: "
                                       "qwen2.5-vl-3b, qwen2.5-vl-7b, internvl3-2b or "
                                       "internvl3-8b")
    plan.add_argument("--hardware", help="predict stage times and TTFT per mode on h200, "
                                         "h200-ib, h100, cpu or a calibration JSON file")
    plan.add_argument("--video", help="a video file: print its decode work per rank (keyframe "
                      "structure; predicted seconds with --hardware; frames chosen by --model's "
                      "family, default qwen-vl-utils' rules) and stop")
    plan.add_argument("--frames", type=int, help="sampled video frames: the context is then "
                                                 "this video's prompt (replaces --context-len)")
    plan.add_argument("--height", type=int, help="frame height in pixels (with --frames; "
                                                 f"default {DEFAULT_FRAME_SIDE})")
    plan.add_argument("--width", type=int, help="frame width in pixels (with --frames; "
                                                f"default {DEFAULT_FRAME_SIDE})")
    plan.add_argument("--tokens-per-patch", type=int,
                      help="LLM tokens per 2 frames instead of the runtime's sampling rules, "
                           "e.g. 4641 for the reference's uncapped 1440p frames")
    plan.add_argument("--modes", default=",".join(MODE_NAMES), help="modes to predict")
    plan.add_argument("--pipeline", action="store_true",
                      help="predict with vision.pipeline=true (frames decoded and processed "
                           "chunk by chunk in the vision stage, overlapped on GPUs)")
    plan.add_argument("--answer-tokens", type=int, default=1,
                      help="tokens of the answer (the first included): also predict the "
                           "seconds per decoded token and to the last token (default 1)")
    prune = plan.add_mutually_exclusive_group()
    prune.add_argument("--keep-rate", type=float,
                       help="predict pruned video: the fraction of the video's tokens kept, "
                            "whole temporal patches dropped before the vision tower (as "
                            "video.static_threshold does; measure it on the footage: "
                            "benchmarks/bench_pruning.py prints it)")
    prune.add_argument("--pruning-rate", type=float,
                       help="predict video.pruning_rate: that fraction of the video's tokens "
                            "dropped after the vision tower, which still encodes every patch")
    plan.add_argument("--dtype-bytes", type=int, default=None,
                      help="bytes per element (default: 2 for the memory estimate; the "
                           "hardware's for predictions, 2 on GPUs and 4 on CPU)")
    ev = plan.add_argument_group("evaluation (--eval: the wall time of a benchmark per split "
                                 "of --world-size into rank groups)")
    ev.add_argument("--eval", action="store_true",
                    help="predict apbv eval's wall time for every --groups G and recommend one")
    ev.add_argument("--bench", choices=("longvideobench", "vnbench"))
    ev.add_argument("--data", help="the benchmark's directory (its videos' headers are read)")
    ev.add_argument("--annotation", help="annotation file in --data or a path")
    ev.add_argument("--limit", type=int, help="only the first N samples")
    ev.add_argument("--mode", default="spava", help="the mode of the run (default spava)")
    ev.add_argument("--max-pixels", type=int, help="per-frame pixel cap (video.max_pixels)")
    ev.add_argument("--min-pixels", type=int, help="per-frame pixel floor (video.min_pixels)")
    ev.add_argument("--idle", action="store_true",
                    help="with --hardware cpu: the preset's idle-machine rates as they are "
                         "(default: each of --world-size processes measures its share of a "
                         "core first, about 2 s, so a loaded machine is predicted as loaded)")
    plan.set_defaults(run=run)


def run_eval_plan(args: argparse.Namespace) -> int:
    """``plan --eval``: the predicted wall time per G and the recommended G."""
    from apbv import cost
    from apbv.eval.data import load_samples
    from apbv.eval.forecast import forecast, forecast_lines, sample_work
    from apbv.modes import get_mode

    if args.bench is None or args.data is None:
        raise ValueError("plan --eval needs --bench and --data")
    get_mode(args.mode)
    if args.model is not None:
        dims = cost.checkpoint_dims(args.model)
    else:
        dims = cost.preset_dims(args.preset or "qwen2.5-vl-7b")
    hw: Any = cost.hardware(args.hardware or "h200")
    name = hw.name
    if args.hardware == "cpu" and not args.idle:
        import tempfile

        from apbv.cost.calibrate import calibrate_here
        from apbv.synthetic.videos import write_decode_probe

        with tempfile.TemporaryDirectory(prefix="apbv-decode-probe-") as tmp:
            hw = calibrate_here(hw, args.world_size,  # one per group size H
                                video=write_decode_probe(tmp))
        name = hw[args.world_size].name.split(";")[0] + "; a collective " + ", ".join(
            f"{1e3 * (h.link_latency_s if r > 1 else h.solo_collective_s):.2f} ms on {r}"
            for r, h in sorted(hw.items(), reverse=True)) + " rank(s); a video's open and a " \
            "frame beyond its pixels " + ", ".join(
                f"{1e3 * h.video_open_s:.2f} and {1e3 * h.decode_frame_s:.2f} ms on {r}"
                for r, h in sorted(hw.items(), reverse=True))
    samples = load_samples(args.bench, args.data, args.annotation)[:args.limit]
    video = {k: v for k, v in (("nframes", args.frames), ("max_pixels", args.max_pixels),
                               ("min_pixels", args.min_pixels)) if v is not None}
    work = sample_work(samples, dims, video)
    forecasts = forecast(work, dims, hw, world_size=args.world_size, mode=args.mode,
                         answer_tokens=args.answer_tokens)
    frames = sorted(w.frames for w in work)
    print(f"{args.bench}: {len(work)} samples, {frames[0]}-{frames[-1]} frames, context "
          f"{min(w.context_len for w in work)}-{max(w.context_len for w in work)} tokens; "
          f"mode {args.mode} on {args.world_size} ranks of {name} "
          f"({args.preset or args.model or 'qwen2.5-vl-7b'}; {args.answer_tokens}-token "
          f"answers; model load not counted)")
    print("\n".join(forecast_lines(forecasts, name.split(";")[0])))
    return 0


def run(args: argparse.Namespace) -> int:
    from apbv import cost
    from apbv.config import GenerateConfig
    from apbv.modes import get_mode
    from apbv.plan import make_plan

    if args.eval:
        return run_eval_plan(args)
    if args.video is not None:
        from apbv.cost.footage import footage_lines

        hw = None if args.hardware is None else cost.hardware(args.hardware)
        family: dict[str, Any] = {}
        if args.model is not None:  # the checkpoint's frame choice (its processor, no weights)
            from transformers import AutoProcessor

            from apbv.model.front import prompt_rules

            cost.checkpoint_dims(args.model)  # ValueError naming a missing or unknown one
            processor = AutoProcessor.from_pretrained(args.model, local_files_only=True)
            family = {"planner": prompt_rules(processor).plan_sampling,
                      "rules": f"{type(processor).__name__}'s"}
        print("\n".join(footage_lines(args.video, args.world_size, hw, **family)))
        return 0
    predicting = any(x is not None for x in (args.hardware, args.preset, args.frames))
    dims = None
    if args.preset is not None:
        if cost.preset_name(args.preset) != args.preset:  # the configs' spelling: accepted
            print(f"note: model preset {args.preset!r} read as "
                  f"{cost.preset_name(args.preset)!r}", file=sys.stderr)
        dims = cost.preset_dims(args.preset)
    elif args.model:
        dims = cost.model_dims(cost.read_config(args.model))
    if predicting and dims is None:
        raise ValueError("a prediction needs the model's sizes: pass --model DIR or --preset "
                         f"({', '.join(cost.MODEL_PRESETS)})")
    context_len, frames = args.context_len, 0
    grid: tuple[int, int] | None = None
    if args.frames is not None:
        assert dims is not None  # --frames is a prediction: refused above without the sizes
        if dims.frame_side is not None:  # every frame one fixed tile (InternVL3)
            side = dims.frame_side // dims.patch_size // dims.spatial_merge_size
            grid, patches = (side, side), args.frames // dims.temporal_patch_size
            print(f"frames resized to {dims.frame_side}x{dims.frame_side} tiles "
                  f"({side * side} tokens each)")
        elif args.tokens_per_patch is not None:
            grid = cost.squarest_grid(args.tokens_per_patch)
            patches = args.frames // 2
        elif (args.height is None) != (args.width is None):
            raise ValueError("--frames needs both --height and --width (or neither: "
                             f"{DEFAULT_FRAME_SIDE}x{DEFAULT_FRAME_SIDE} frames)")
        else:
            if args.height is None:
                args.height = args.width = DEFAULT_FRAME_SIDE
                print(f"frames of {DEFAULT_FRAME_SIDE}x{DEFAULT_FRAME_SIDE} pixels assumed "
                      "(--height/--width set the source's size)")
            patches, rows, cols = cost.video_grid(args.frames, args.height, args.width,
                                                  patch_size=dims.patch_size)
            grid = (rows, cols)
        frames = dims.temporal_patch_size * patches
        if dims.video_start is None:  # a checkpoint: its own chat template says
            dims = cost.checkpoint_dims(args.model)
        context_len = cost.video_context_len(dims, patches, grid)
    plan = make_plan(context_len, args.query_len, args.world_size,
                     anchor_len=args.anchor_len, passing_len=args.passing_len)
    print(plan.describe())
    if dims is not None:  # decode reserve: the default max_new_tokens
        merge = dims.spatial_merge_size
        for line in cost.memory_lines(
                plan, dims, patches=frames // dims.temporal_patch_size,
                grid_hw=(grid[0] * merge, grid[1] * merge) if frames and grid else (0, 0),
                dtype_bytes=args.dtype_bytes or 2,
                reserve_tokens=GenerateConfig().max_new_tokens):
            print(line)
    if not predicting:
        return 0
    assert dims is not None  # a prediction without sizes was refused above
    hw = cost.hardware(args.hardware or "h200")
    modes = args.modes.split(",")
    for mode in modes:
        get_mode(mode)
    source = args.height * args.width if args.height and args.width else None
    keep_rate, keep_by = _keep(args, frames)
    work = cost.Workload.of(dims, context_len=context_len, query_len=args.query_len,
                            world_size=args.world_size, frames=frames, grid=grid,
                            source_pixels=source, dtype_bytes=args.dtype_bytes,
                            anchor_len=args.anchor_len, passing_len=args.passing_len,
                            pipeline=args.pipeline, answer_tokens=args.answer_tokens,
                            keep_rate=keep_rate, keep_by=keep_by)
    predictions = [cost.estimate(get_mode(mode), dims, work, hw) for mode in modes]
    video = (f"{frames} frames, {grid[0]}x{grid[1]} tokens per {dims.temporal_patch_size} "
             f"frame{'s' if dims.temporal_patch_size > 1 else ''}" if frames and grid
             else "no video")
    if work.pruned:
        video += _pruned_note(work, predictions[0], dims.temporal_patch_size)
    if args.answer_tokens > 1:
        video += (f"; {args.answer_tokens}-token answers, decode eager"
                  + (" and with decode.graphs" if hw.graph_capture_s else ""))
    print(f"\npredicted on {hw.name} ({args.preset or args.model}; {video}; "
          f"N={context_len} Q={args.query_len} H={args.world_size}; seconds, slowest rank):")
    print(cost.rates_line(hw))
    print(cost.prediction_table(predictions))
    if work.pruned:
        whole = [cost.estimate(get_mode(mode), dims, dataclasses.replace(work, keep_rate=1.0),
                               hw) for mode in modes]
        print("pruned / unpruned: " + "; ".join(
            f"{p.mode} TTFT {p.ttft_s / u.ttft_s:.2f}x, vision + prefill "
            f"{_vision_prefill(p) / _vision_prefill(u):.2f}x" for p, u in zip(predictions, whole)))
    return 0


def _keep(args: argparse.Namespace, frames: int) -> tuple[float, str]:
    """The keep rate and how the rest go, from ``--keep-rate`` or ``--pruning-rate``."""
    if args.keep_rate is None and args.pruning_rate is None:
        return 1.0, "patch"
    if not frames:
        raise ValueError("--keep-rate and --pruning-rate prune video: pass --frames")
    if args.pruning_rate is not None:
        if not 0 <= args.pruning_rate < 1:
            raise ValueError(f"--pruning-rate must be in [0, 1), got {args.pruning_rate}")
        return 1.0 - args.pruning_rate, "token"
    if not 0 < args.keep_rate <= 1:
        raise ValueError(f"--keep-rate must be in (0, 1], got {args.keep_rate}")
    return args.keep_rate, "patch"


def _pruned_note(work: Workload, prediction: Prediction, unit: int) -> str:
    """What the keep rate leaves of the video, for the prediction's heading."""
    from apbv.cost.stages import kept_patches

    patches = work.frames // unit
    tokens = f"N={prediction.plan.context_len} as run"
    if work.keep_by == "patch":
        kept = kept_patches(patches, work.keep_rate)
        return (f"; pruned to {work.keep_rate:g} of the video tokens: {kept} of {patches} "
                f"temporal patches encoded, {tokens}")
    return f"; pruning_rate {1 - work.keep_rate:g} after the tower: every patch encoded, {tokens}"


def _vision_prefill(p: Prediction) -> float:
    return p.seconds["vision"] + p.seconds["prefill"]
