"""Decode and conversion cost on camera footage (``Hardware.coded_frame_s_per_pixel`` and
``Hardware.convert_s_per_pixel``).

    python benchmarks/footage_decode.py FILE      # a camera file (make-test-video --camera)

PyAV's reader as the runtime runs it (``video.decode=needed``, one thread) reads the frames
the runtime samples (2 fps, ``video.max_pixels`` 16 x 28 x 28, as ``bench_ttft --footage
camera``): the seconds spent in the decoder (walking from each keyframe to the sampled frames,
the frames nothing refers to skipped, and the sampled frames' RGB conversion) per coded frame
walked (:func:`apbv.video.gop.walked_frames`) and per source pixel are
``coded_frame_s_per_pixel``; the seconds resizing each sampled frame
(:func:`apbv.video.load.resize_frame_into`) per source pixel are ``convert_s_per_pixel``
(the RGB conversion is in the decoder's part: the reader hands over RGB frames). Seconds are
the thread's CPU time (``time.thread_time``), so a machine shared with other work changes them
less than wall seconds. :func:`coded_frame_rates` is what ``calibrate_cpu.py`` calls.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def coded_frame_rates(path: str, repeats: int = 2) -> dict[str, Any]:
    """{"coded_frame_s_per_pixel", "convert_s_per_pixel", "sampled", "walked", "decoded",
    "pixels", "decode_s", "convert_s"} of ``path`` (the best of ``repeats`` reads of each
    part)."""
    import torch

    from apbv.video import VideoSpec, plan_sampling
    from apbv.video.decoders import _open
    from apbv.video.gop import walked_frames
    from apbv.video.load import resize_frame_into

    spec = VideoSpec(path, fps=2.0, backend="pyav", decode="needed", decode_threads=1,
                     max_pixels=16 * 28 * 28, min_pixels=3136)
    decode_s = convert_s = float("inf")
    for _ in range(repeats):
        reader = _open(spec)
        try:
            meta, keys = reader.meta, reader.keyframes
            sampling = plan_sampling(spec, meta)
            indices = sampling.indices
            out = torch.empty((3, sampling.resized_height, sampling.resized_width),
                              dtype=torch.uint8)
            scratch = torch.empty((1, 3, meta.height, meta.width))
            frames = reader.frames(indices)
            spent = [0.0, 0.0]
            for _ in indices:
                start = time.thread_time()
                frame = next(frames)
                mid = time.thread_time()
                resize_frame_into(frame, out, scratch)
                spent[0] += mid - start
                spent[1] += time.thread_time() - mid
            decoded = reader.frames_decoded
        finally:
            reader.close()
        decode_s, convert_s = min(decode_s, spent[0]), min(convert_s, spent[1])
    pixels, walked = meta.width * meta.height, walked_frames(keys, indices)
    return {"coded_frame_s_per_pixel": decode_s / (walked * pixels),
            "convert_s_per_pixel": convert_s / (len(indices) * pixels),
            "sampled": len(indices), "walked": walked, "decoded": decoded, "pixels": pixels,
            "decode_s": decode_s, "convert_s": convert_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("video", help="camera footage (make-test-video --camera)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(coded_frame_rates(args.video, args.repeats), indent=1))


if __name__ == "__main__":
    main()
