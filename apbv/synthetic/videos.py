"""Small deterministic synthetic videos for tests and demos, written with PyAV.

Frame ``i`` of a video at ``fps`` frames per second (see :func:`make_frame`):

- the background has one colour per second of video (second ``floor(i / fps)``), taken from a
  palette drawn from ``seed``, so content depends on the position in time;
- a square in the complementary colour moves 3 pixels right and 2 down per frame (wrapping),
  so neighbouring frames differ too;
- a "needle" frame (:func:`make_needle_frame`, ``needles`` of :func:`write_test_video`) also
  has a large centred square of one given colour, for needle-in-a-haystack style questions.

Frames are encoded as yuv420p with libx264 when PyAV's bundled FFmpeg has it, else mpeg4; the
decoded frames match :func:`make_frame` up to compression error. PyAV (the ``video`` extra) is
imported only when a video is written.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path

import numpy as np

PALETTE_SIZE = 64


def _palette(seed: int) -> np.ndarray:
    """(PALETTE_SIZE, 3) uint8 colours, mid-range so the complementary square stands out."""
    rng = np.random.default_rng(seed)
    return rng.integers(32, 224, size=(PALETTE_SIZE, 3), dtype=np.uint8)


def _rate(fps: float | Fraction) -> Fraction:
    if isinstance(fps, bool) or not isinstance(fps, (int, float, Fraction)):
        raise ValueError(f"fps must be a number, got {fps!r}")
    if not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"fps must be a finite number > 0, got {fps!r}")
    return Fraction(fps).limit_denominator(1001)


def _check_size(width: int, height: int) -> None:
    for name, value in (("width", width), ("height", height)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 2 or value % 2:
            raise ValueError(f"{name} must be an even integer >= 2 (yuv420p), got {value!r}")


def make_frame(index: int, *, fps: float | Fraction, width: int, height: int,
               seed: int = 0) -> np.ndarray:
    """Frame ``index`` of the synthetic video: uint8 (height, width, 3), RGB."""
    rate = _rate(fps)
    _check_size(width, height)
    palette = _palette(seed)
    background = palette[math.floor(index / rate) % PALETTE_SIZE]
    frame = np.empty((height, width, 3), dtype=np.uint8)
    frame[...] = background
    side = max(2, min(width, height) // 4)
    x = (3 * index) % (width - side + 1)
    y = (2 * index) % (height - side + 1)
    frame[y:y + side, x:x + side] = 255 - background
    return frame


def _check_colour(colour: tuple[int, int, int]) -> None:
    if len(colour) != 3 or not all(isinstance(c, int) and 0 <= c <= 255 for c in colour):
        raise ValueError(f"colour must be 3 integers in 0..255 (RGB), got {colour!r}")


def make_needle_frame(index: int, colour: tuple[int, int, int], *, fps: float | Fraction,
                      width: int, height: int, seed: int = 0) -> np.ndarray:
    """:func:`make_frame` with a centred square of side min(width, height) / 2 in ``colour``
    (RGB, 0..255) drawn over it: the inserted "needle"."""
    _check_colour(colour)
    frame = make_frame(index, fps=fps, width=width, height=height, seed=seed)
    side = max(2, min(width, height) // 2)
    y, x = (height - side) // 2, (width - side) // 2
    frame[y:y + side, x:x + side] = colour
    return frame


def write_test_video(
    path: str | os.PathLike[str],
    *,
    num_frames: int,
    fps: float | Fraction,
    width: int,
    height: int,
    seed: int = 0,
    codec: str | None = None,
    gop: int | None = None,
    faststart: bool = False,
    needles: Mapping[int, tuple[int, int, int]] | None = None,
) -> Path:
    """Write ``num_frames`` frames of :func:`make_frame` to ``path``; returns the path.

    The container follows the file extension (.mp4, .mkv, .avi, ...). ``codec``: None picks
    libx264 (B-frames, keyframe every ``gop`` frames; x264's default 250 when None; x264 also
    puts keyframes at most colour changes) or mpeg4 when x264 is absent. ``faststart`` moves the
    mp4 index to the front, so a truncated file still opens (a realistic "cut in half"
    download). ``num_frames=0`` writes a fragmented mp4 whose video track has no frames (only
    .mp4/.mov). ``needles`` maps frame indices to colours: those frames are
    :func:`make_needle_frame`.
    """
    import av

    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 0:
        raise ValueError(f"num_frames must be an integer >= 0, got {num_frames!r}")
    rate = _rate(fps)
    _check_size(width, height)
    if codec is None:
        codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    if codec not in av.codecs_available:
        raise ValueError(f"codec {codec!r} is not in PyAV's FFmpeg build")
    if gop is not None and (isinstance(gop, bool) or not isinstance(gop, int) or gop < 1):
        raise ValueError(f"gop must be an integer >= 1, got {gop!r}")
    needles = {} if needles is None else dict(needles)
    outside = sorted(i for i in needles if not 0 <= i < num_frames)
    if outside:
        raise ValueError(f"needle frame indices {outside} are outside 0..{num_frames - 1}")
    for colour in needles.values():
        _check_colour(colour)
    path = Path(path)
    options: dict[str, str] = {}
    if num_frames == 0:
        if path.suffix.lower() not in (".mp4", ".mov"):
            raise ValueError(f"num_frames=0 needs an .mp4 or .mov path, got {str(path)!r}")
        options["movflags"] = "frag_keyframe+empty_moov"  # keeps the empty track in the file
    elif faststart:
        options["movflags"] = "faststart"
    try:  # after the checks: a refused video leaves no directory behind
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise ValueError(f"cannot create the directory of {str(path)!r}: a file is in the "
                         "way") from exc
    with av.open(str(path), mode="w", options=options) as container:
        # x264's macroblock tree (mbtree, on by default) is off: with it, identical frames
        # came out as different bytes in a process that had decoded video before (found by
        # benchmarks/stress_decoders.py; frame QPs differ, a decoded pixel by up to 6).
        stream = container.add_stream(codec, rate=rate, options={"x264-params": "mbtree=0"}
                                      if codec == "libx264" else {})
        assert isinstance(stream, av.VideoStream), stream  # a video codec's stream
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        # One encoder thread and no mbtree: the same bytes on every run, however busy the
        # machine is and whatever the process did before.
        stream.codec_context.thread_count = 1
        if gop is not None:
            stream.codec_context.gop_size = gop
        if num_frames == 0:
            container.start_encoding()
        for index in range(num_frames):
            if index in needles:
                image = make_needle_frame(index, needles[index], fps=rate, width=width,
                                          height=height, seed=seed)
            else:
                image = make_frame(index, fps=rate, width=width, height=height, seed=seed)
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_decode_probe(directory: str | os.PathLike[str]) -> str:
    """Write the small video :func:`apbv.cost.calibrate.probe_decoding` reads
    (:data:`apbv.cost.calibrate.DECODE_PROBE`: side, frame rate, seconds) into ``directory``
    as ``decode_probe.mp4``; its path."""
    from pathlib import Path

    from apbv.cost.calibrate import DECODE_PROBE

    side, fps, seconds = DECODE_PROBE
    return str(write_test_video(Path(directory) / "decode_probe.mp4",
                                num_frames=round(fps * seconds), fps=fps, width=side,
                                height=side, seed=0))
