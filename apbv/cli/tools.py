"""The make-* tools and training: ``apbv make-tiny-model``, ``train-tiny`` and
``make-test-video`` (``make-eval-fixtures`` is registered beside ``eval``)."""

from __future__ import annotations

import argparse
from typing import Any

from apbv.model.families import TINY_FAMILIES


def register(sub: Any) -> None:
    tiny = sub.add_parser("make-tiny-model", help="write a tiny random Qwen2.5-VL checkpoint")
    tiny.add_argument("--out", required=True, help="directory to create")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--overwrite", action="store_true")
    tiny.add_argument("--size", default="tiny", choices=("tiny", "medium"),
                      help="medium: 4 layers, hidden 256, head dim 64 (for benchmarks)")
    tiny.add_argument("--family", default="qwen2_5_vl", choices=TINY_FAMILIES,
                      help="the model type to write (internvl: a tiny InternVL3-2B shape; "
                           "qwen3_vl: a tiny Qwen3-VL-8B shape)")
    tiny.set_defaults(run=run)

    train = sub.add_parser("train-tiny", help="train the tiny model on synthetic needle "
                                              "videos (CPU; --threads 1 on a busy machine)")
    train.add_argument("--out", required=True, help="checkpoint directory to write")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--steps", type=int, default=None, help="training steps (default 6000)")
    train.add_argument("--threads", type=int, default=2)
    train.add_argument("--init", metavar="DIR",
                       help="continue from this trained checkpoint (default steps, rate and "
                            "curriculum: train_tiny.FINE_TUNE)")
    train.add_argument("--mix", default="needles", choices=(
                           "needles", "choice-camera", "letters", "camera", "camera-settle",
                           "named", "joint"),
                       help="the step schedule: the free-form needle kinds (default), with "
                            "multiple-choice and static-camera videos, with the needle "
                            "fixtures' multiple-choice letters, or with static-camera videos "
                            "(camera; camera-settle: two free-form steps to one camera step, "
                            "for a continuation of a camera checkpoint), or answered "
                            "'green (B)' (named; joint: with text-only lookup steps) "
                            "(apbv.synthetic.mix)")
    train.add_argument("--grow", type=int, help="with --init: append this many decoder "
                       "layers, zero-output at first (apbv.synthetic.grow)")
    train.add_argument("--old-lr-scale", type=float, help="with --grow: the rate of the "
                       "other weights, times the grown layers' (0: frozen)")
    train.add_argument("--probe-every", type=int, default=0, metavar="STEPS",
                       help="print a held-out letter accuracy every STEPS steps")
    train.add_argument("--overwrite", action="store_true")
    train.set_defaults(run=run)

    video = sub.add_parser("make-test-video", help="write a synthetic test video")
    video.add_argument("--out", required=True, help="file to write (.mp4)")
    video.add_argument("--seconds", type=float, default=40.0)
    video.add_argument("--fps", type=float, default=4.0)
    video.add_argument("--width", type=int, default=224)
    video.add_argument("--height", type=int, default=224)
    video.add_argument("--seed", type=int, default=0)
    video.add_argument("--needle", metavar="COLOUR",
                       help="a needle video the trained tiny model answers about: noise with "
                            "one flash of COLOUR (red, green, blue, yellow, cyan, magenta, "
                            "white, black); --seconds and --seed apply")
    video.add_argument("--camera", choices=("h264", "h265"), help="camera-like footage in this "
                       "codec instead (see apbv.video.footage; e.g. --fps 30 --width 1920 "
                       "--height 1080)")
    video.add_argument("--gop-seconds", type=float, help="with --camera (default 2)")
    video.add_argument("--bframes", type=int, help="with --camera (default 0)")
    video.add_argument("--vfr", action="store_true", help="with --camera: variable frame rate")
    video.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """One of the three tools, by ``args.command``; prints what it wrote. ``args.argv`` (the
    command line's arguments) is recorded with a trained checkpoint."""
    if args.command == "make-tiny-model":
        from apbv.model.families import write_tiny_family

        print(write_tiny_family(args.family, args.out, seed=args.seed, overwrite=args.overwrite,
                                size=args.size))
        return 0
    if args.command == "train-tiny":
        from apbv.synthetic.mix import FINE_TUNE_OVERRIDES
        from apbv.synthetic.train_tiny import FINE_TUNE, TrainConfig, train

        overrides: dict[str, Any] = dict(FINE_TUNE, **FINE_TUNE_OVERRIDES[args.mix],
                                         init=args.init) if args.init else {}
        overrides["mix"] = args.mix
        for name in ("steps", "grow", "old_lr_scale"):
            if getattr(args, name) is not None:
                overrides[name] = getattr(args, name)
        overrides["probe_every"] = args.probe_every
        cfg = TrainConfig(seed=args.seed, threads=args.threads, **overrides)
        command = "python -m apbv " + " ".join(a for a in args.argv)
        print(train(cfg, args.out, overwrite=args.overwrite, command=command))
        return 0
    assert args.command == "make-test-video", args.command
    if args.camera or args.vfr or (args.gop_seconds, args.bframes) != (None, None):
        from apbv.video.footage import camera_video_cli

        print(camera_video_cli(args))
        return 0
    if args.needle:
        from apbv.synthetic.needle_video import write_needle_video

        print(write_needle_video(args.out, args.needle, seconds=args.seconds, seed=args.seed))
        return 0
    from apbv.synthetic.videos import write_test_video

    frames = round(args.seconds * args.fps)
    print(write_test_video(args.out, num_frames=frames, fps=args.fps, width=args.width,
                           height=args.height, seed=args.seed))
    return 0
