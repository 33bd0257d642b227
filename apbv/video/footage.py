"""Camera-like test footage: a mostly static scene with a few moving objects, encoded as real
cameras and recorders do (25-30 fps H.264 or H.265, a keyframe every 1-4 s, B-frames on or off).

Frame ``i`` (:func:`camera_frame`, planar yuv420p, drawn directly in YUV so that writing a long
1080p file costs little more than the encoder's own time):

- a fixed textured background (a luma gradient with a block pattern drawn from ``seed``), the
  same in every frame: a camera on a wall;
- ``objects`` rectangles of distinct grey levels and colours that cross the frame at constant
  speeds (a car, a person), wrapping around;
- a small block whose brightness steps once per second (a timestamp overlay), so content also
  depends on the position in time.

``vfr=True`` writes a variable-frame-rate file: frame durations alternate between 1 and 2
nominal frame intervals in a fixed pattern (timestamps in a 1/90000 s time base), as cameras
that drop frames under load produce. PyAV (the ``video`` extra) is imported only when writing.
"""

from __future__ import annotations

import argparse
import math
import os
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import av

CAMERA_CODECS = ("h264", "h265")
"""Codecs :func:`write_camera_video` writes (libx264, libx265 in PyAV's FFmpeg build)."""

_ENCODERS = {"h264": "libx264", "h265": "libx265"}


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _background(width: int, height: int, seed: int) -> np.ndarray:
    """uint8 (height * 3 // 2, width) yuv420p planes of the static scene."""
    rng = np.random.default_rng(seed)
    y = np.linspace(40, 200, height, dtype=np.float32)[:, None] \
        + np.linspace(-20, 20, width, dtype=np.float32)[None, :]
    block = 16
    pattern = rng.integers(-24, 24, size=(-(-height // block), -(-width // block)))
    y += np.kron(pattern, np.ones((block, block)))[:height, :width]
    planes = np.empty((height * 3 // 2, width), dtype=np.uint8)
    planes[:height] = np.clip(y, 0, 255).astype(np.uint8)
    planes[height:] = 128  # grey chroma; objects colour it
    return planes


def camera_frame(index: int, *, fps: float, width: int, height: int, seed: int = 0,
                 objects: int = 3, background: np.ndarray | None = None) -> np.ndarray:
    """Frame ``index`` as uint8 (height * 3 // 2, width) yuv420p planes (Y, then U and V of
    (height/2, width/2) each, stacked row-wise as PyAV's ``yuv420p`` ndarray format).
    ``background``: :func:`_background`'s planes, passed to avoid redrawing them."""
    planes = (_background(width, height, seed) if background is None else background).copy()
    luma = planes[:height]
    u = planes[height:height + height // 4].reshape(height // 2, width // 2)
    v = planes[height + height // 4:].reshape(height // 2, width // 2)
    rng = np.random.default_rng(seed + 1)
    for k in range(objects):
        ow = max(2, int(width * rng.uniform(0.05, 0.15))) // 2 * 2
        oh = max(2, int(height * rng.uniform(0.08, 0.25))) // 2 * 2
        speed = rng.uniform(1.0, 6.0) * width / 1920  # pixels per frame at 1080p scale
        y0 = int(rng.uniform(0, height - oh)) // 2 * 2
        x0 = int((rng.uniform(0, width) + speed * index) % (width + ow)) - ow
        x0 -= x0 % 2
        lo, hi = max(0, x0), min(width, x0 + ow)
        if hi <= lo:
            continue
        luma[y0:y0 + oh, lo:hi] = 60 + 60 * k % 180
        u[y0 // 2:(y0 + oh) // 2, lo // 2:hi // 2] = int(rng.integers(40, 216))
        v[y0 // 2:(y0 + oh) // 2, lo // 2:hi // 2] = int(rng.integers(40, 216))
    second = math.floor(index / fps)
    side = max(2, min(width, height) // 16) // 2 * 2
    luma[:side, :2 * side] = (37 * second) % 200 + 30
    return planes


def write_camera_video(
    path: str | os.PathLike[str],
    *,
    seconds: float,
    fps: float = 30.0,
    width: int = 1920,
    height: int = 1080,
    codec: str = "h264",
    gop_seconds: float = 2.0,
    bframes: int = 0,
    vfr: bool = False,
    seed: int = 0,
    preset: str = "veryfast",
) -> Path:
    """Write camera-like footage (see the module docstring) to ``path`` (.mp4 or .mkv).

    ``fps`` nominal frames per second; ``gop_seconds`` keyframe interval (x264/x265 keyint,
    scene-cut keyframes off, so keyframes are exactly every round(fps * gop_seconds) frames);
    ``bframes`` consecutive B-frames (0: none, as most IP cameras); ``preset`` the encoder's
    speed preset. One encoder thread: the same bytes on every run. Returns the path.
    """
    import av

    if codec not in CAMERA_CODECS:
        raise ValueError(f"codec must be one of {CAMERA_CODECS}, got {codec!r}")
    encoder = _ENCODERS[codec]
    if encoder not in av.codecs_available:
        raise ValueError(f"codec {codec!r} needs {encoder}, which PyAV's FFmpeg build lacks")
    for name, value in (("seconds", seconds), ("fps", fps), ("gop_seconds", gop_seconds)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    for name, value in (("width", width), ("height", height)):
        if _check_int(name, value, 16) % 2:
            raise ValueError(f"{name} must be even (yuv420p), got {value!r}")
    _check_int("bframes", bframes, 0)
    if bframes > 16:
        raise ValueError(f"bframes must be in 0..16, got {bframes!r}")
    rate = Fraction(fps).limit_denominator(1001)
    num_frames = max(1, round(seconds * fps))
    keyint = max(1, round(fps * gop_seconds))
    params = f"keyint={keyint}:min-keyint={keyint}:scenecut=0:bframes={bframes}"
    options = {"preset": preset}
    if codec == "h264":
        options["x264-params"] = params + ":threads=1"
    else:
        options["x265-params"] = params + ":pools=none:frame-threads=1:log-level=error"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    background = _background(width, height, seed)
    time_base = Fraction(1, 90000)
    tick = Fraction(1, 1) / rate / time_base  # 90 kHz ticks per nominal frame
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(encoder, rate=rate, options=options)
        assert isinstance(stream, av.VideoStream), stream  # a video codec's stream
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.thread_count = 1
        stream.codec_context.gop_size = keyint
        if vfr:
            stream.codec_context.time_base = time_base
        pts = 0
        for index in range(num_frames):
            frame = av.VideoFrame.from_ndarray(
                camera_frame(index, fps=fps, width=width, height=height, seed=seed,
                             background=background), format="yuv420p")
            if vfr:
                frame.pts, frame.time_base = round(pts * tick), time_base
                pts += 2 if index % 5 == 3 else 1  # every fifth interval is a dropped frame
            mux_frame(container, stream, frame)
        mux_frame(container, stream, None)
    return path


def mux_frame(container: av.container.OutputContainer, stream: av.VideoStream,
              frame: av.VideoFrame | None) -> None:
    """Encode ``frame`` on ``stream`` and mux its packets into ``container``; None: flush the
    encoder's last packets."""
    for packet in stream.encode(frame):
        container.mux(packet)


def camera_video_cli(args: argparse.Namespace) -> Path:
    """``make-test-video --camera CODEC``: :func:`write_camera_video` from the parsed options
    (--out, --seconds, --fps, --width, --height, --seed, --gop-seconds, --bframes, --vfr)."""
    if not args.camera:
        raise ValueError("--gop-seconds, --bframes and --vfr go with --camera h264|h265")
    return write_camera_video(
        args.out, seconds=args.seconds, fps=args.fps, width=args.width, height=args.height,
        codec=args.camera, seed=args.seed, vfr=args.vfr,
        gop_seconds=2.0 if args.gop_seconds is None else args.gop_seconds,
        bframes=0 if args.bframes is None else args.bframes)
