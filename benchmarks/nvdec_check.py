"""NVDEC (``video.backend=nvdec``) against PyAV on camera footage: pixel difference and speed.

    python benchmarks/nvdec_check.py [--seconds 20] [--out FILE.json]

Writes 1080p camera-like footage (30 fps H.264, a keyframe every 2 s, 3 B-frames) into a
temporary directory, decodes the frames sampled at 2 fps with PyAV (``video.decode=needed``)
and with NVDEC, and prints the largest and mean difference in levels of 0..255 and the
seconds of each (a device sync closes NVDEC's). Exits 2 when NVDEC cannot run here (torchcodec
or a GPU missing, named on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from apbv.video import VideoSpec
from apbv.video.decoders import _open
from apbv.video.footage import write_camera_video
from apbv.video.sampling import plan_sampling


def _decode(spec: VideoSpec) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    reader = _open(spec)
    try:
        frames = reader.read(plan_sampling(spec, reader.meta).indices)
        if frames.is_cuda:
            torch.cuda.synchronize()
    finally:
        reader.close()
    return frames.cpu(), time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--out", help="also write the result as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="apbv-nvdec-") as tmp:
        path = write_camera_video(Path(tmp) / "camera.mp4", seconds=args.seconds, bframes=3)
        host, host_s = _decode(VideoSpec(str(path), backend="pyav"))
        try:
            device, device_s = _decode(VideoSpec(str(path), backend="nvdec"))
        except ValueError as err:
            print(f"nvdec_check: {err}", file=sys.stderr)
            return 2
    diff = (host.int() - device.int()).abs()
    result = {"frames": host.shape[0], "size": list(host.shape[1:3]),
              "max_level_diff": int(diff.max()), "mean_level_diff": float(diff.float().mean()),
              "pyav_s": host_s, "nvdec_s": device_s}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
