"""The decoding chunk at the native frame size: apbv.cost.request_memory's ``native_pixels``
term against the measured peak of one rank's frame loading, on the CPU.

    python benchmarks/bench_native_decode.py          # 1080p, 2048^2, 4K, 4096^2, 8192^2
    python benchmarks/bench_native_decode.py --sizes 3840x2160 --out native.md

For each native size and each decoder (decord, the default, and PyAV), a video of 4 solid
frames (libx264, tiny bitrate: the decoder's work is the frame size, not the content) is
loaded by :func:`apbv.video.load_rank_frames` (rank 0 of 1, every frame sampled, the default
``video.decode=needed``) in a fresh subprocess, after a warm-up load of a 320x240 video
(imports and the fast resize kernel's compilation done: about 130 MB once per process).
Measured: the rise of the process's peak resident set (VmHWM, reset through
/proc/self/clear_refs just before the load). Modelled: the ``decode`` part of
:func:`apbv.cost.request_memory` with ``native_pixels`` (34 bytes a native pixel for the frame
being decoded, 8 for each frame of a chunk). Output: a markdown table with measured /
modelled.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = ("1920x1080", "2048x2048", "3840x2160", "4096x4096", "8192x8192")
FRAMES = 4

CHILD = """
import json, sys
import torch
torch.set_num_threads(1)
from apbv.video import VideoSpec, load_rank_frames

def peak():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) * 1024

path, warm, backend = sys.argv[1:4]
load_rank_frames(VideoSpec(warm, backend=backend, nframes=4), 0, 1)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = peak()
frames = load_rank_frames(VideoSpec(path, backend=backend, nframes=4), 0, 1)
print(json.dumps({"peak": peak() - before, "frames": len(frames.frames)}))
"""


def modelled(native: tuple[int, int], frames: int) -> int:
    """The ``decode`` part with ``native_pixels`` for ``frames`` frames on one rank."""
    from apbv import cost
    from apbv.plan import make_plan

    dims = cost.preset_dims("qwen2.5-vl-7b")
    est = cost.request_memory(dims, make_plan(2000, 20, 1), patches=frames // 2,
                              grid_hw=(16, 16), dtype_bytes=4, reserve_tokens=0, rank=0,
                              native_pixels=native[0] * native[1])
    return est.parts["decode"]


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from tests.native_video import write_large_frame_video

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), metavar="WxH")
    p.add_argument("--backends", nargs="+", default=["decord", "pyav"])
    p.add_argument("--out", help="also write the table to this file")
    args = p.parse_args()
    rows = ["| native size | decoder | measured MiB | modelled MiB | measured / modelled |",
            "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        # large enough for the fast resize kernel: its one-time compilation is not counted
        warm = write_large_frame_video(Path(tmp) / "warm.mp4", 320, 240, FRAMES)
        for size in args.sizes:
            width, height = (int(x) for x in size.split("x"))
            video = write_large_frame_video(Path(tmp) / f"{size}.mp4", width, height, FRAMES)
            model = modelled((height, width), FRAMES)
            for backend in args.backends:
                out = subprocess.run([sys.executable, "-c", CHILD, str(video), str(warm),
                                      backend], capture_output=True, text=True, check=True,
                                     cwd=ROOT).stdout
                peak = json.loads(out.splitlines()[-1])["peak"]
                rows.append(f"| {size} | {backend} | {peak / 2**20:.0f} | {model / 2**20:.0f} "
                            f"| {peak / model:.2f} |")
                print(rows[-1], flush=True)
    table = ("Peak memory of one rank's frame loading (load_rank_frames, 4 frames of each native "
             "size, video.decode=needed, torch 1 thread, after a 320x240 warm-up load): measured "
             "= the rise of VmHWM (reset by /proc/self/clear_refs before the load); modelled = "
             "apbv.cost.request_memory's decode part with native_pixels.\n\n"
             + "\n".join(rows) + "\n")
    if args.out:
        Path(args.out).write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
