"""Command line of apbv: the apbv command, or python -m apbv (the same).

    python -m apbv demo                                  # the whole pipeline on 2 CPU ranks
    torchrun --nproc_per_node 8 -m apbv generate --config qwen2_5_vl_7b_8gpu \\
        --model /ckpt/Qwen2.5-VL-7B-Instruct --video clip.mp4 --question "What happens?"
    python -m apbv plan --context-len 32768 --query-len 64 --world-size 8 [--model DIR]
    python -m apbv make-tiny-model --out .cache/tiny-qwen2.5-vl
    python -m apbv make-test-video --out .cache/demo.mp4 --seconds 40
    python -m apbv attention-demo                        # the attention op alone vs exact
    torchrun --nproc_per_node 8 -m apbv eval --bench longvideobench --data /data/LongVideoBench \
        --model /ckpt/Qwen2.5-VL-7B-Instruct --mode spava [--limit N] [--compare exact]
    python -m apbv make-eval-fixtures --bench vnbench --out .cache/vnbench-fixture
    python -m apbv serve --world-size 2 --media-root ~/videos    # OpenAI-style HTTP server
    torchrun --nproc_per_node 2 -m apbv watch --config tiny_cpu --source rtsp://cam/live \
        --ask-every 10 --question "Is anyone at the door?"     # or questions on stdin
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from apbv import package_version
from apbv.eval.data import BENCHMARKS
from apbv.extras import MissingExtra
from apbv.model.tiny_families import TINY_FAMILIES
from apbv.modes import MODE_NAMES

DEFAULT_FRAME_SIDE = 448
"""``plan --frames`` without ``--height``/``--width``: square frames of this side (stated in
the output; a source's real size is better)."""


def _add_plan_args(p: argparse.ArgumentParser, *, context_len: int, world_size: int) -> None:
    p.add_argument("--context-len", type=int, default=context_len,
                   help="N, tokens before the query")
    p.add_argument("--query-len", type=int, default=64, help="Q, tokens of the query")
    p.add_argument("--world-size", type=int, default=world_size, help="H, number of ranks")
    p.add_argument("--anchor-len", type=int, default=None, help="A (default about N/64)")
    p.add_argument("--passing-len", type=int, default=None, help="P (default about N/128)")


def _add_config_args(p: argparse.ArgumentParser, default_preset: str | None) -> None:
    p.add_argument("--config", default=default_preset,
                   help="TOML preset name (configs/, shipped in the package) or a path "
                        "(default: %(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. --set attention.passing_len=256")
    p.add_argument("--model", help="checkpoint directory (model.path)")
    p.add_argument("--mode", choices=MODE_NAMES, help="mode (attention.mode)")
    frames = p.add_mutually_exclusive_group()
    frames.add_argument("--fps", type=float, help="frames sampled per second (video.fps)")
    frames.add_argument("--nframes", type=int, help="frames to sample (video.nframes)")
    p.add_argument("--min-pixels", type=int, help="per-frame pixel floor (video.min_pixels)")
    p.add_argument("--max-pixels", type=int, help="per-frame pixel cap (video.max_pixels)")
    p.add_argument("--video-backend", choices=("decord", "pyav"), help="video.backend")
    p.add_argument("--max-new-tokens", type=int, help="generate.max_new_tokens")


def _config_from_args(args: argparse.Namespace) -> Any:
    from apbv.config import load_config

    overrides = list(args.set)
    for flag, key in (("model", "model.path"), ("mode", "attention.mode"),
                      ("fps", "video.fps"), ("nframes", "video.nframes"),
                      ("min_pixels", "video.min_pixels"),
                      ("max_pixels", "video.max_pixels"), ("video_backend", "video.backend"),
                      ("max_new_tokens", "generate.max_new_tokens")):
        value = getattr(args, flag)
        if value is not None:  # as TOML: floats keep nan/inf (json writes NaN, Infinity)
            text = repr(value).lower() if isinstance(value, float) else json.dumps(value)
            overrides.append(f"{key}={text}")
    return load_config(args.config, overrides)  # --nframes replaces the preset's fps


def _print_result(result: Any, *, as_json: bool) -> None:
    print(f"answer: {result.answer!r}")
    for choice in result.choices or ():
        print(f"  choice {choice['text']!r}: p={choice['prob']:.4f} "
              f"(logprob {choice['logprob']:.4f}, {choice['tokens']} tokens)")
    stages = "  ".join(f"{k} {v:.3f}s" for k, v in result.seconds.items())
    print(f"TTFT {result.ttft_s:.3f} s on {result.world_size} rank(s), mode {result.mode} "
          f"({result.context_len}+{result.query_len} prompt tokens, {result.frames} frames)")
    print(f"stages (max over ranks): {stages}")
    print(f"video embeddings moved: {result.embedding_bytes} bytes "
          f"(an all-gather would move {result.allgather_bytes})")
    if as_json:
        print(json.dumps(result.to_json()))


def _generate(args: argparse.Namespace) -> int:
    from apbv.distributed import destroy_distributed, init_distributed
    from apbv.engine.engine import Engine
    from apbv.engine.request import Request

    cfg = _config_from_args(args)
    if not cfg.model.path:
        raise ValueError("no model: pass --model DIR or set model.path in the config")
    request = Request.from_config(cfg, args.video, args.question,  # checked before any work
                                  choices=args.choices, system=args.system)
    backend = None if cfg.parallel.backend == "auto" else cfg.parallel.backend
    info = init_distributed(backend=backend, timeout_s=cfg.parallel.timeout_s)
    try:
        result = Engine(cfg, info).generate(request)
        if info.rank == 0:
            _print_result(result, as_json=args.json)
    finally:
        destroy_distributed()
    return 0


def _watch(args: argparse.Namespace) -> int:
    from apbv.config import load_config
    from apbv.distributed import destroy_distributed, init_distributed
    from apbv.engine.engine import Engine
    from apbv.engine.runtime import raise_if_any_failed
    from apbv.watch import WatchOptions, run_watch

    overrides = list(args.set)
    if args.model is not None:
        overrides.append(f"model.path={json.dumps(args.model)}")
    if args.max_new_tokens is not None:
        overrides.append(f"generate.max_new_tokens={args.max_new_tokens}")
    cfg = load_config(args.config, overrides)
    if not cfg.model.path:
        raise ValueError("no model: pass --model DIR or set model.path in the config")
    options = WatchOptions(  # checked before any work
        source=args.source, fps=args.fps, window_s=args.window_s,
        window_tokens=args.window_tokens, min_pixels=args.min_pixels,
        max_pixels=args.max_pixels, max_new_tokens=cfg.generate.max_new_tokens,
        ask_every=args.ask_every, question=args.question, until_eof=args.until_eof,
        follow=args.follow, end_after_s=args.end_after_s or None,
        buffer_frames=args.buffer_frames, as_json=args.json)
    backend = None if cfg.parallel.backend == "auto" else cfg.parallel.backend
    info = init_distributed(backend=backend, timeout_s=cfg.parallel.timeout_s)
    try:
        error = None  # a missing source is found before loading the model
        if info.rank == 0 and "://" not in options.source and \
                not os.path.exists(options.source):
            error = ValueError(f"source {options.source!r} is not a URL, a directory or an "
                               "existing file")
        raise_if_any_failed(error, info.group)
        return run_watch(Engine(cfg, info), info, options,
                         questions=sys.stdin if info.rank == 0 else None)
    finally:
        destroy_distributed()


def _eval(args: argparse.Namespace) -> int:
    from apbv.distributed import destroy_distributed, init_distributed
    from apbv.engine.engine import Engine
    from apbv.eval.data import parse_where
    from apbv.eval.harness import EvalSpec, run_eval, summary

    cfg = _config_from_args(args)
    if not cfg.model.path:
        raise ValueError("no model: pass --model DIR or set model.path in the config")
    mode = cfg.attention.mode
    spec = EvalSpec(bench=args.bench, data_dir=args.data, mode=mode,
                    out=args.out or f"eval_results/{args.bench}_{mode}.jsonl",
                    annotation=args.annotation, limit=args.limit, where=parse_where(args.where),
                    compare=args.compare, max_new_tokens=args.max_new_tokens,
                    retry_failed=args.retry_failed, skip_missing=args.skip_missing)
    backend = None if cfg.parallel.backend == "auto" else cfg.parallel.backend
    info = init_distributed(backend=backend, timeout_s=cfg.parallel.timeout_s)
    try:
        results = run_eval(spec, cfg, lambda: Engine(cfg, info), progress=sys.stderr)
        if results is not None:
            print(summary(results))
            print(f"results: {spec.results_path}  samples: {spec.out}")
    finally:
        destroy_distributed()
    return 0


def _plan(args: argparse.Namespace) -> int:
    from apbv import cost
    from apbv.config import GenerateConfig
    from apbv.modes import get_mode
    from apbv.plan import make_plan

    predicting = any(x is not None for x in (args.hardware, args.preset, args.frames))
    dims = None
    if args.preset is not None:
        dims = cost.preset_dims(args.preset)
    elif args.model:
        dims = cost.model_dims(cost.read_config(args.model))
    if predicting and dims is None:
        raise ValueError("a prediction needs the model's sizes: pass --model DIR or --preset "
                         f"({', '.join(cost.MODEL_PRESETS)})")
    context_len, grid, frames = args.context_len, None, 0
    if args.frames is not None:
        if args.tokens_per_patch is not None:
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
            patches, *grid = cost.video_grid(args.frames, args.height, args.width,
                                             patch_size=dims.patch_size)
        frames = 2 * patches
        if dims.video_start is None:  # a checkpoint: its own chat template says
            dims = cost.checkpoint_dims(args.model)
        context_len = dims.video_start + patches * grid[0] * grid[1] + 1  # 1: <|vision_end|>
    plan = make_plan(context_len, args.query_len, args.world_size,
                     anchor_len=args.anchor_len, passing_len=args.passing_len)
    print(plan.describe())
    if dims is not None:  # decode reserve: the default max_new_tokens
        merge = dims.spatial_merge_size
        for line in cost.memory_lines(
                plan, dims, patches=frames // 2,
                grid_hw=(grid[0] * merge, grid[1] * merge) if frames else (0, 0),
                dtype_bytes=args.dtype_bytes or 2,
                reserve_tokens=GenerateConfig().max_new_tokens):
            print(line)
    if not predicting:
        return 0
    hw = cost.hardware(args.hardware or "h200")
    modes = args.modes.split(",")
    for mode in modes:
        get_mode(mode)
    source = args.height * args.width if args.height and args.width else None
    predictions = [
        cost.predict(mode, dims, context_len=context_len, query_len=args.query_len,
                     world_size=args.world_size, frames=frames, grid=grid, hw=hw,
                     source_pixels=source, dtype_bytes=args.dtype_bytes,
                     anchor_len=args.anchor_len, passing_len=args.passing_len,
                     pipeline=args.pipeline, answer_tokens=args.answer_tokens)
        for mode in modes
    ]
    video = (f"{frames} frames, {grid[0]}x{grid[1]} tokens per 2 frames" if frames
             else "no video")
    if args.answer_tokens > 1:
        video += f"; {args.answer_tokens}-token answers, eager decode"
    print(f"\npredicted on {hw.name} ({args.preset or args.model}; {video}; "
          f"N={context_len} Q={args.query_len} H={args.world_size}; seconds, slowest rank):")
    print(cost.prediction_table(predictions))
    return 0


def _prog() -> str:
    """The command's name as run: ``apbv`` (the console script) or ``python -m apbv``."""
    return "apbv" if os.path.basename(sys.argv[0] or "") == "apbv" else "python -m apbv"


def main(argv: list[str] | None = None) -> int:
    """The ``apbv`` console script and ``python -m apbv``: parse ``argv`` (default
    ``sys.argv[1:]``) and run the subcommand; returns the exit status (2: bad input or a
    missing extra, as one ``error:`` line).

    Building the parser imports nothing heavy (torch, transformers, ray, fastapi): each
    subcommand imports what it needs when it runs, so ``--help`` and ``--version`` are quick.
    """
    parser = argparse.ArgumentParser(prog=_prog(), description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--version", action="version", version=f"apbv {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="answer a question about a video (run under torchrun)")
    _add_config_args(gen, default_preset=None)
    gen.add_argument("--video", required=True, help="video file")
    gen.add_argument("--question", required=True, help="question about the video")
    gen.add_argument("--system", metavar="TEXT",
                     help="the chat template's system turn (plain text; default: the "
                          "template's own)")
    gen.add_argument("--choices", action="append", metavar="TEXT",
                     help="a closed-vocabulary answer; repeat for each (2 .. 64): every choice "
                          "is scored by its exact log-probability and the likeliest is the "
                          "answer, nothing is generated")
    gen.add_argument("--json", action="store_true", help="also print one JSON line")

    demo = sub.add_parser("demo", help="the whole pipeline on local CPU ranks, spava vs exact")
    _add_config_args(demo, default_preset="tiny_cpu")
    demo.add_argument("--world-size", type=int, default=2)
    demo.add_argument("--video", help="video file (default: a generated needle video, asked of "
                                      "the trained tiny model)")
    demo.add_argument("--question", help="question (default: the needle video's, or 'What "
                                         "colour is the square at the end?' for --video)")
    demo.add_argument("--json", action="store_true", help="also print one JSON line")

    plan = sub.add_parser("plan", help="print the layout and memory without loading weights; "
                                       "with --hardware, the predicted TTFT of every mode")
    _add_plan_args(plan, context_len=32768, world_size=8)
    plan.add_argument("--model", help="checkpoint directory: read config.json for the memory "
                                      "estimate and the prediction (no weights are loaded)")
    plan.add_argument("--preset", help="model sizes for the prediction instead of --model: "
                                       "qwen2.5-vl-3b or qwen2.5-vl-7b")
    plan.add_argument("--hardware", help="predict stage times and TTFT per mode on h200, "
                                         "h200-ib, cpu or a calibration JSON file")
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
    plan.add_argument("--dtype-bytes", type=int, default=None,
                      help="bytes per element (default: 2 for the memory estimate; the "
                           "hardware's for predictions, 2 on GPUs and 4 on CPU)")

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random Qwen2.5-VL checkpoint")
    tiny.add_argument("--out", required=True, help="directory to create")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--overwrite", action="store_true")
    tiny.add_argument("--size", default="tiny", choices=("tiny", "medium"),
                      help="medium: 4 layers, hidden 256, head dim 64 (for benchmarks)")
    tiny.add_argument("--family", default="qwen2_5_vl", choices=TINY_FAMILIES,
                      help="the model type to write (internvl: a tiny InternVL3-2B shape)")

    train = sub.add_parser("train-tiny", help="train the tiny model on synthetic needle "
                                              "videos (CPU, about 15 minutes)")
    train.add_argument("--out", required=True, help="checkpoint directory to write")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--steps", type=int, default=None, help="training steps (default 5000)")
    train.add_argument("--threads", type=int, default=2)
    train.add_argument("--overwrite", action="store_true")

    video = sub.add_parser("make-test-video", help="write a synthetic test video")
    video.add_argument("--out", required=True, help="file to write (.mp4)")
    video.add_argument("--seconds", type=float, default=40.0)
    video.add_argument("--fps", type=float, default=4.0)
    video.add_argument("--width", type=int, default=224)
    video.add_argument("--height", type=int, default=224)
    video.add_argument("--seed", type=int, default=0)

    ev = sub.add_parser("eval", help="LongVideoBench or VNBench accuracy (run under torchrun); "
                                     "resumable")
    _add_config_args(ev, default_preset=None)
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

    fixtures = sub.add_parser("make-eval-fixtures",
                              help="write a small synthetic dataset in a benchmark's format")
    fixtures.add_argument("--bench", required=True, choices=BENCHMARKS)
    fixtures.add_argument("--out", required=True, help="directory to write")
    fixtures.add_argument("--count", type=int, help="LongVideoBench questions (4) or VNBench "
                                                    "questions per type (1)")
    fixtures.add_argument("--seed", type=int, default=0)

    attn = sub.add_parser("attention-demo", help="the attention op alone on CPU ranks vs exact")
    _add_plan_args(attn, context_len=8192, world_size=2)
    attn.add_argument("--heads", type=int, default=8)
    attn.add_argument("--kv-heads", type=int, default=2)
    attn.add_argument("--head-dim", type=int, default=64)
    attn.add_argument("--seed", type=int, default=0)
    attn.add_argument("--json", action="store_true", help="also print one JSON line")

    watch = sub.add_parser("watch", help="watch a live video (file, segment directory, URL) "
                                         "and answer questions as it plays (torchrun or one "
                                         "process)")
    watch.add_argument("--config", default=None, help="TOML preset name or path")
    watch.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one config value")
    watch.add_argument("--model", help="checkpoint directory (model.path)")
    watch.add_argument("--source", required=True,
                       help="a URL (rtsp://, http(s)://), a directory of segments, or a video "
                            "file (followed as it grows)")
    watch.add_argument("--fps", type=float, default=2.0, help="frames sampled per second")
    watch.add_argument("--window-s", type=float, help="keep the last S seconds of video")
    watch.add_argument("--window-tokens", type=int,
                       help="keep at most N video tokens per rank on average")
    watch.add_argument("--min-pixels", type=int, help="per-frame pixel floor")
    watch.add_argument("--max-pixels", type=int, help="per-frame pixel cap")
    watch.add_argument("--max-new-tokens", type=int, help="generate.max_new_tokens")
    watch.add_argument("--ask-every", type=float, metavar="S",
                       help="ask --question every S seconds of video (and at the end)")
    watch.add_argument("--question", help="the periodic question (with --ask-every)")
    watch.add_argument("--until-eof", action="store_true",
                       help="stop at the end of stdin (questions, one per line)")
    watch.add_argument("--no-follow", dest="follow", action="store_false",
                       help="read a file source to its end at once, as a finished recording "
                            "(default: follow it as it grows, ending --end-after-s after it "
                            "stops growing; a growing file must be streamable: .ts, .mkv, "
                            "fragmented .mp4)")
    watch.add_argument("--end-after-s", type=float, default=10.0,
                       help="a followed file or segment directory ends after this long "
                            "without news (0: never)")
    watch.add_argument("--buffer-frames", type=int, default=256,
                       help="captured frames waiting at most (then the oldest are dropped)")
    watch.add_argument("--json", action="store_true", help="one JSON line per event")

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server over H Ray rank actors")
    _add_config_args(serve, default_preset="tiny_cpu")
    from apbv.serve.main import add_serve_args

    add_serve_args(serve)

    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            from apbv.serve.main import run_server

            return run_server(_config_from_args(args), args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "eval":
            return _eval(args)
        if args.command == "watch":
            return _watch(args)
        if args.command == "make-eval-fixtures":
            from apbv.eval.fixtures import make_eval_fixtures

            print(make_eval_fixtures(args.bench, args.out, count=args.count, seed=args.seed))
            return 0
        if args.command == "demo":
            from apbv.demo import run_pipeline_demo

            model_given = args.model is not None or any(
                s.strip().startswith("model.path") for s in args.set)
            run_pipeline_demo(_config_from_args(args), world_size=args.world_size,
                              video=args.video, question=args.question, as_json=args.json,
                              model_given=model_given)
            return 0
        if args.command == "make-tiny-model":
            from apbv.model.tiny_families import write_tiny_family

            print(write_tiny_family(args.family, args.out, seed=args.seed,
                                    overwrite=args.overwrite, size=args.size))
            return 0
        if args.command == "train-tiny":
            from apbv.model.train_tiny import TrainConfig, train

            overrides = {"steps": args.steps} if args.steps is not None else {}
            cfg = TrainConfig(seed=args.seed, threads=args.threads, **overrides)
            command = "python -m apbv " + " ".join(
                a for a in (argv if argv is not None else sys.argv[1:]))
            print(train(cfg, args.out, overwrite=args.overwrite, command=command))
            return 0
        if args.command == "make-test-video":
            from apbv.synthetic import write_test_video

            frames = round(args.seconds * args.fps)
            print(write_test_video(args.out, num_frames=frames, fps=args.fps, width=args.width,
                                   height=args.height, seed=args.seed))
            return 0
        from apbv.attention_demo import DemoConfig, run_demo

        cfg = DemoConfig(
            world_size=args.world_size, context_len=args.context_len, query_len=args.query_len,
            heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
            anchor_len=args.anchor_len, passing_len=args.passing_len, seed=args.seed,
        )
        cfg.plan()  # validate before starting any rank
        return 0 if run_demo(cfg, as_json=args.json) else 1
    except (ValueError, MissingExtra) as exc:  # a missing extra: one line naming it
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # local ranks (demo): bad input is a ValueError on every rank
        from apbv.distributed import RankFailure

        if not isinstance(exc, RankFailure):
            raise
        messages = {message for kind, message in exc.errors.values()}
        if any(kind != "ValueError" for kind, _ in exc.errors.values()) or len(messages) != 1:
            raise
        print(f"error: {messages.pop()}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
