"""Decode cost per coded frame on camera footage (``Hardware.coded_frame_s_per_pixel``).

    python benchmarks/footage_decode.py FILE      # a camera file (make-test-video --camera)

PyAV's reader as the runtime runs it (``video.decode=needed``, one thread) reads, from every
keyframe interval, once its keyframe alone (the sampled frame's own decode, RGB conversion
and resize) and once its last frame (the whole interval walked to it, the frames nothing
refers to skipped). The difference, per coded frame walked beyond the sampled one and per
source pixel, is the constant; the per sampled frame cost is reported beside it. Seconds are
the thread's CPU time (``time.thread_time``), so a machine shared with other work changes
them less than wall seconds. :func:`coded_frame_rates` is what ``calibrate_cpu.py`` calls.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def coded_frame_rates(path: str, repeats: int = 2) -> dict[str, Any]:
    """{"coded_frame_s_per_pixel", "sampled_frame_s_per_pixel", "intervals", "walked",
    "pixels"} of ``path`` (best of ``repeats`` per read)."""
    from apbv.video import VideoSpec, plan_sampling
    from apbv.video.decoders import _open
    from apbv.video.gop import walked_frames
    from apbv.video.load import _decode_resized

    spec = VideoSpec(path, fps=1.0, backend="pyav", decode="needed", decode_threads=1,
                     max_pixels=16 * 28 * 28, min_pixels=3136)

    def cpu_s(indices: list[int]) -> tuple[float, int, int]:
        best = float("inf")
        for _ in range(repeats):
            reader = _open(spec)
            try:
                sampling = plan_sampling(spec, reader.meta)
                start = time.thread_time()
                _decode_resized(reader, indices, sampling)
                best = min(best, time.thread_time() - start)
            finally:
                reader.close()
        return best, reader.meta.width * reader.meta.height, reader.meta.total_frames

    reader = _open(spec)
    keys, total = list(reader.keyframes), reader.meta.total_frames
    reader.close()
    ends = [nxt - 1 for nxt in keys[1:]] + [total - 1]
    keyed, pixels, _ = cpu_s(keys)
    walked_s, _, _ = cpu_s(ends)
    walked = walked_frames(keys, ends)
    extra = walked - len(ends)
    return {"coded_frame_s_per_pixel": max(walked_s - keyed, 0.0) / (extra * pixels),
            "sampled_frame_s_per_pixel": keyed / (len(keys) * pixels),
            "intervals": len(keys), "walked": walked, "pixels": pixels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("video", help="camera footage (make-test-video --camera)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(coded_frame_rates(args.video, args.repeats), indent=1))


if __name__ == "__main__":
    main()
