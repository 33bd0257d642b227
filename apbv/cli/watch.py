"""``apbv watch``: watch a live video (file, segment directory, URL) and answer questions as it
plays, under torchrun or in one process (the loop: :mod:`apbv.cli.watch_loop`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from apbv.cli.common import distributed, require_model
from apbv.watch.rules import RULES


def register(sub: Any) -> None:
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
    watch.add_argument("--watch", metavar="QUESTION",
                       help="a standing question asked after every appended batch of frames; "
                            "an event is printed when its answer changes (with --choices)")
    watch.add_argument("--choices", help="the standing question's closed vocabulary: a,b,c")
    watch.add_argument("--rule", choices=RULES, default="change",
                       help="change: the top choice changes; threshold: --choice's probability "
                            "crosses --threshold (back under it less --hysteresis)")
    watch.add_argument("--choice", help="the choice a threshold rule watches")
    watch.add_argument("--threshold", type=float, default=0.5)
    watch.add_argument("--hysteresis", type=float, default=0.1)
    watch.add_argument("--hold", type=int, default=1,
                       help="evaluations in a row a new answer must hold before an event")
    watch.add_argument("--watch-every", type=float, metavar="S",
                       help="ask the standing question at most once per S seconds of video")
    watch.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from apbv.cli.watch_loop import WatchOptions, run_watch
    from apbv.cli.watch_standing import StandingWatch
    from apbv.config import load_config
    from apbv.engine.agree import raise_if_any_failed
    from apbv.engine.engine import Engine
    from apbv.watch.question import parse_choices
    from apbv.watch.rules import Rule

    overrides = list(args.set)
    if args.model is not None:
        overrides.append(f"model.path={json.dumps(args.model)}")
    if args.max_new_tokens is not None:
        overrides.append(f"generate.max_new_tokens={args.max_new_tokens}")
    cfg = load_config(args.config, overrides)
    require_model(cfg)
    standing = None
    if (args.watch is None) != (args.choices is None):
        raise ValueError("--watch and --choices go together: a standing question answers "
                         "from a closed vocabulary")
    if args.watch is not None:
        standing = StandingWatch(
            args.watch, parse_choices(args.choices),
            Rule(args.rule, args.choice, args.threshold, args.hysteresis, args.hold),
            args.watch_every)
    options = WatchOptions(  # checked before any work
        source=args.source, fps=args.fps, window_s=args.window_s,
        window_tokens=args.window_tokens, min_pixels=args.min_pixels,
        max_pixels=args.max_pixels, max_new_tokens=cfg.generate.max_new_tokens,
        ask_every=args.ask_every, question=args.question, until_eof=args.until_eof,
        follow=args.follow, end_after_s=args.end_after_s or None,
        buffer_frames=args.buffer_frames, as_json=args.json, standing=standing)
    with distributed(cfg) as info:
        error = None  # a missing source is found before loading the model
        if info.rank == 0 and "://" not in options.source and \
                not os.path.exists(options.source):
            error = ValueError(f"source {options.source!r} is not a URL, a directory or an "
                               "existing file")
        raise_if_any_failed(error, info.group)
        return run_watch(Engine(cfg, info), info, options,
                         questions=sys.stdin if info.rank == 0 else None)
