"""NVDEC (``video.backend=nvdec``) against PyAV on camera footage: pixel difference and speed.

    python benchmarks/nvdec_check.py [--seconds 20] [--out FILE.json]
    python benchmarks/nvdec_check.py --coupling     # only check torchcodec against torch

Writes 1080p camera-like footage (30 fps H.264, a keyframe every 2 s, 3 B-frames) into a
temporary directory, decodes the frames sampled at 2 fps with PyAV (``video.decode=needed``)
and with NVDEC, and prints the largest and mean difference in levels of 0..255 and the
seconds of each (a device sync closes NVDEC's). Exits 2 when NVDEC cannot run here (torchcodec
or a GPU missing, named on stderr).

torchcodec is built against one torch minor version (and loads the system's FFmpeg): before
any decoding, its version is checked against torch's by :data:`TORCHCODEC_TORCH` (torchcodec's
own compatibility table) and its decoders are imported, which is where a mismatched torch or
a missing FFmpeg fails (:func:`check_coupling`; ``--coupling`` stops there).
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

TORCHCODEC_TORCH = {"0.1": "2.5", "0.2": "2.6", "0.3": "2.7", "0.4": "2.7", "0.5": "2.7",
                    "0.6": "2.8", "0.7": "2.8", "0.8": "2.9", "0.9": "2.9"}
"""torchcodec minor version -> the torch minor version it is built for (torchcodec's README);
a newer torchcodec than the table knows is left to the import of its decoders."""


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def coupling(torchcodec_version: str, torch_version: str) -> str | None:
    """Why this torchcodec cannot work with this torch by the table (None: it can, or the
    table does not know it)."""
    want = TORCHCODEC_TORCH.get(_minor(torchcodec_version))
    if want is not None and want != _minor(torch_version):
        return (f"torchcodec {torchcodec_version} is built for torch {want}, not "
                f"{torch_version}: install the torchcodec of torch {_minor(torch_version)}")
    return None


def check_coupling() -> str | None:
    """Why NVDEC cannot be used with the installed torchcodec (None: it can be tried)."""
    from importlib import metadata

    try:
        version = metadata.version("torchcodec")
    except metadata.PackageNotFoundError:
        return "torchcodec is not installed (carry its wheel for this torch)"
    why = coupling(version, torch.__version__)
    if why is not None:
        return why
    try:
        import torchcodec.decoders  # noqa: F401  (loads its native library and FFmpeg's)
    except Exception as err:  # torchcodec raises RuntimeError/OSError naming what is missing
        return f"torchcodec {version} does not load with torch {torch.__version__}: {err}"
    known = "listed" if _minor(version) in TORCHCODEC_TORCH else "not in the table; it loads"
    print(f"nvdec_check: torchcodec {version} with torch {torch.__version__} ({known})")
    return None




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
    parser.add_argument("--coupling", action="store_true",
                        help="only check torchcodec's version against torch's, and its import")
    args = parser.parse_args(argv)
    why = check_coupling()
    if why is not None:
        print(f"nvdec_check: {why}", file=sys.stderr)
        return 2
    if args.coupling:
        return 0
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
