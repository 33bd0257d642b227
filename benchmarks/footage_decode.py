"""Decode and conversion cost on camera footage (``Hardware.coded_frame_s_per_pixel``,
``keyframe_s_per_pixel`` and ``convert_s_per_pixel``).

    python benchmarks/footage_decode.py FILE      # a camera file (make-test-video --camera)
    python benchmarks/footage_decode.py FILE --ranks 2   # each rank's share: predicted, measured

PyAV's reader as the runtime runs it (``video.decode=needed``, one thread) reads the frames
the runtime samples (2 fps, ``video.max_pixels`` 16 x 28 x 28, as ``bench_ttft --footage
camera``), and then the file's keyframes alone. Seconds in the decoder (walking from each
keyframe to the sampled frames, the frames nothing refers to skipped, and the sampled frames'
RGB conversion) are split as the cost model prices them
(:func:`apbv.cost.predict.footage_frame_s`): per coded frame walked
(:func:`apbv.video.gop.walk`), ``coded_frame_s_per_pixel``, and per keyframe interval walked
into (its seek and keyframe, beyond a coded frame), ``keyframe_s_per_pixel``: the two reads
give two equations (walked x c + intervals x k = the first read's seconds; keyframes x (c + k)
= the second's). The seconds resizing each sampled frame
(:func:`apbv.video.bicubic.frame_resizer`, the runtime's: the fast kernel where it has been
checked, else torch's) per source pixel are ``convert_s_per_pixel``. Seconds are the thread's
CPU time (``time.thread_time``), so a machine shared with other work changes them less than
wall seconds. :func:`coded_frame_rates` is what ``calibrate_cpu.py`` calls.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from typing import Any


def _read(path: str, pick: Callable[[Any, Sequence[int]], Sequence[int]],
          resize: bool) -> tuple[float, float, Any, Any, Sequence[int], int]:
    """One read of the frames ``pick(sampling, keyframes)``: (decoder CPU s, resize CPU s,
    meta, keyframes, those frames, frames decoded)."""
    import torch

    from apbv.video import VideoSpec, plan_sampling
    from apbv.video.bicubic import frame_resizer
    from apbv.video.decoders import _open

    spec = VideoSpec(path, fps=2.0, backend="pyav", decode="needed", decode_threads=1,
                     max_pixels=16 * 28 * 28, min_pixels=3136)
    reader = _open(spec)
    try:
        meta, keys = reader.meta, reader.keyframes
        sampling = plan_sampling(spec, meta)
        wanted = pick(sampling, keys)
        out = torch.empty((3, sampling.resized_height, sampling.resized_width),
                          dtype=torch.uint8)
        resizer = frame_resizer((meta.height, meta.width), tuple(out.shape[1:]))
        reader.expect(wanted)
        frames = reader.frames(wanted)
        spent = [0.0, 0.0]
        for _ in wanted:
            start = time.thread_time()
            frame = next(frames)
            mid = time.thread_time()
            if resize:
                resizer(frame, out)
            spent[0] += mid - start
            spent[1] += time.thread_time() - mid
        return spent[0], spent[1], meta, keys, wanted, reader.frames_decoded
    finally:
        reader.close()


def coded_frame_rates(path: str, repeats: int = 2) -> dict[str, Any]:
    """{"coded_frame_s_per_pixel", "keyframe_s_per_pixel", "convert_s_per_pixel", "sampled",
    "walked", "intervals", "decoded", "keyframes", "pixels", "decode_s", "keyframes_s",
    "convert_s"} of ``path`` (the best of ``repeats`` reads of each part)."""
    from apbv.video.gop import walk

    decode_s = convert_s = keyframes_s = float("inf")
    for _ in range(repeats):
        seconds, resize_s, meta, keys, indices, decoded = _read(
            path, lambda sampling, keys: sampling.indices, resize=True)
        decode_s, convert_s = min(decode_s, seconds), min(convert_s, resize_s)
        seconds = _read(path, lambda sampling, keys: list(keys), resize=False)[0]
        keyframes_s = min(keyframes_s, seconds)
    pixels, (walked, intervals) = meta.width * meta.height, walk(keys, indices)
    per_key = keyframes_s / (len(keys) * pixels)  # c + k
    coded = (decode_s / pixels - intervals * per_key) / (walked - intervals)
    return {"coded_frame_s_per_pixel": coded, "keyframe_s_per_pixel": per_key - coded,
            "convert_s_per_pixel": convert_s / (len(indices) * pixels),
            "sampled": len(indices), "walked": walked, "intervals": intervals,
            "decoded": decoded, "keyframes": len(keys), "pixels": pixels,
            "decode_s": decode_s, "keyframes_s": keyframes_s, "convert_s": convert_s}


def rank_shares(path: str, world_size: int, repeats: int = 2) -> list[dict[str, Any]]:
    """Per rank of ``world_size`` (the balanced split), its share read alone in this process
    as the rank reads it: {"rank", "sampled", "walked", "intervals", "predicted_s" (the
    ``cpu`` preset's :func:`apbv.cost.predict.footage_frame_s`), "measured_s" (decoder and
    resize thread CPU seconds, best of ``repeats``)}."""
    from apbv import cost
    from apbv.cost.predict import footage_frame_s
    from apbv.plan import patch_ranges
    from apbv.video.gop import walk

    rows = []
    for rank in range(world_size):
        def share(sampling: Any, keys: Sequence[int], rank: int = rank) -> Sequence[int]:
            start, end = patch_ranges(sampling.num_patches, world_size)[rank]
            unit = sampling.temporal_patch_size
            return sampling.indices[unit * start:unit * end]

        best = float("inf")
        for _ in range(repeats):
            decode_s, resize_s, meta, keys, frames, _ = _read(path, share, resize=True)
            best = min(best, decode_s + resize_s)
        pixels, (walked, intervals) = meta.width * meta.height, walk(keys, frames)
        rows.append({"rank": rank, "sampled": len(frames), "walked": walked,
                     "intervals": intervals, "measured_s": best,
                     "predicted_s": footage_frame_s(cost.CPU, walked, len(frames), pixels,
                                                    intervals)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("video", help="camera footage (make-test-video --camera)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ranks", type=int,
                        help="instead: each rank's share of this many, predicted and measured")
    args = parser.parse_args()
    if args.ranks:
        print(json.dumps(rank_shares(args.video, args.ranks, args.repeats), indent=1))
        return
    print(json.dumps(coded_frame_rates(args.video, args.repeats), indent=1))


if __name__ == "__main__":
    main()
