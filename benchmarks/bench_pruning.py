"""Temporal pruning on a synthetic static camera: kept fraction and seconds, side by side.

    python benchmarks/bench_pruning.py                       # 2 CPU ranks, 128 frames
    python benchmarks/bench_pruning.py --frames 256 --thresholds 2,4,8 --noise 3

The camera (decoded frames, no file): a fixed textured scene at ``--height`` x ``--width``,
Gaussian sensor noise of ``--noise`` grey levels (standard deviation) on every pixel of every
frame, a slow lighting drift (the whole frame brighter by ``--drift`` grey levels over the
clip), and one event: a coloured square (a tenth of the frame's height) that appears at a
random time and stays for 3 s. Sampled at 2 fps as they are.

One engine per rank (``spava``, the tiny random Qwen2.5-VL unless ``--model``); per threshold
(0 first: unpruned) one warm-up request and ``--repeats`` timed ones; printed per threshold:
the video tokens kept (of the unpruned prompt's), whether the event's patches were kept, and
the median seconds of preprocess (decoding is none here: the signatures), vision, prefill and
TTFT, with the ratio to unpruned in the same run. A threshold's units: the largest change of a
merged patch's mean grey level (0-255) since the last kept temporal patch
(``apbv/video/prune.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apbv.config import load_config  # noqa: E402
from apbv.distributed import DistInfo, spawn_local  # noqa: E402
from apbv.video import DecodedVideo  # noqa: E402
from apbv.video.prune import keep_mask, signatures  # noqa: E402

FPS = 2.0
QUESTION = "What appeared in the scene?"


def camera(frames: int, height: int, width: int, noise: float, drift: float,
           seed: int) -> tuple[DecodedVideo, range]:
    """The static camera of the module docstring and the frames its event spans."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, 3, height // 16, width // 16, generator=g) * 160 + 40
    scene = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear",
                                            align_corners=False)[0]
    start = int(torch.randint(frames // 4, frames // 2, (1,), generator=g))
    event = range(start, min(frames, start + int(3 * FPS)))
    side = max(2, height // 10)
    y, x = (int(torch.randint(0, n - side, (1,), generator=g)) for n in (height, width))
    out = torch.empty(frames, 3, height, width, dtype=torch.uint8)
    for i in range(frames):
        frame = scene + drift * i / frames + torch.randn(scene.shape, generator=g) * noise
        if i in event:
            frame[:, y:y + side, x:x + side] = torch.tensor([250.0, 40.0, 200.0]).view(3, 1, 1)
        out[i] = frame.round().clamp(0, 255).to(torch.uint8)
    return DecodedVideo(out, FPS), event


def _job(info: DistInfo, model: str, video: DecodedVideo, thresholds: list[float],
         repeats: int) -> dict:
    from apbv.engine.engine import Engine
    from apbv.engine.request import Request

    engine = Engine(load_config("tiny_cpu", [f"model.path={model!r}"]), info)
    out = {}
    for threshold in thresholds:
        runs = [engine.generate(Request(video=video, question=QUESTION, mode="spava",
                                        static_threshold=threshold))
                for _ in range(repeats + 1)][1:]
        out[threshold] = {"context_len": runs[0].context_len,
                          "seconds": [r.seconds for r in runs], "ttft": [r.ttft_s for r in runs]}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frames", type=int, default=128)
    p.add_argument("--height", type=int, default=224)
    p.add_argument("--width", type=int, default=336)
    p.add_argument("--noise", type=float, default=3.0, help="sensor noise, grey levels (std)")
    p.add_argument("--drift", type=float, default=6.0, help="lighting drift over the clip")
    p.add_argument("--thresholds", default="2,4,8")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model", default=None, help="checkpoint (default: the tiny random one)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    thresholds = [0.0] + [float(t) for t in args.thresholds.split(",")]
    video, event = camera(args.frames, args.height, args.width, args.noise, args.drift,
                          args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from apbv.model.qwen2_5_vl.tiny import write_tiny_checkpoint

            model = str(write_tiny_checkpoint(Path(tmp) / "tiny-qwen2.5-vl"))
        per_rank = spawn_local(_job, args.ranks, (model, video, thresholds, args.repeats),
                               timeout_s=3600, collective_timeout_s=600)
    res = per_rank[0]
    tokens = (args.height // 28) * (args.width // 28)
    video_tokens = args.frames // 2 * tokens
    text = res[0.0]["context_len"] - video_tokens

    def median(threshold: float, stage: str) -> float:
        if stage == "ttft":
            return statistics.median(res[threshold]["ttft"])
        if stage == "vision+prefill":
            return statistics.median(s.get("vision", 0.0) + s.get("prefill", 0.0)
                                     for s in res[threshold]["seconds"])
        return statistics.median(s.get(stage, 0.0) for s in res[threshold]["seconds"])

    stages = ("preprocess", "vision", "prefill", "vision+prefill", "ttft")
    print(f"{args.frames} frames {args.width}x{args.height} at {FPS:g} fps, noise std "
          f"{args.noise:g}, drift {args.drift:g}, event frames {event.start}-{event.stop - 1}; "
          f"{args.ranks} CPU ranks, spava, median of {args.repeats}")
    print(f"| threshold | video tokens kept | event kept | "
          f"{' | '.join(f'{s} s (x unpruned)' for s in stages)} |")
    print("|---" * (3 + len(stages)) + "|")
    cells_hw = (args.height // 28, args.width // 28)
    for t in thresholds:
        kept = (res[t]["context_len"] - text) / video_tokens
        mask = [True] * (args.frames // 2) if t == 0 else \
            keep_mask(signatures(video.frames, 2, cells_hw), t)
        assert abs(sum(mask) / len(mask) - kept) < 1e-9, (t, sum(mask), kept)  # the same rule
        seen = any(mask[f // 2] and (f // 2) * 2 + 1 >= event.start for f in event)
        cells = [f"{median(t, s):.3f} ({median(t, s) / max(median(0.0, s), 1e-9):.2f}x)"
                 for s in stages]
        print(f"| {t:g} | {kept:.3f} | {'yes' if seen else 'NO'} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
