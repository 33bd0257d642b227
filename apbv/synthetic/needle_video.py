"""A needle video file the trained tiny model (``apbv/assets/needle-tiny``) answers about.

``apbv make-test-video --needle magenta --out media/needle.mp4`` writes one: noise frames
with one flash of the named colour halfway through, drawn exactly as the model's training
videos (:func:`apbv.synthetic.needles.make_sample`, kind ``retrieval``: 56x56 frames, 2 fps,
one temporal patch per second), encoded nearly losslessly so the noise stays noise. Asked
"What colour is the flash?", the tiny model answers the colour.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

MAX_DRAWS = 2000
"""Samples drawn at most to find one whose flash has the asked colour (one in 8 has)."""


def needle_sample_of(colour: str, seconds: float, seed: int = 0):
    """The first retrieval sample (from ``seed``, index 0, 1, ...) whose flash is ``colour``,
    about ``seconds`` long, the flash halfway; ValueError naming the allowed colours."""
    from apbv.synthetic.needles import COLOURS, FPS, MAX_COUNT, make_sample

    if colour not in COLOURS:
        raise ValueError(f"unknown needle colour {colour!r}; allowed: {', '.join(COLOURS)}")
    patches = max(2 * MAX_COUNT, round(seconds * FPS / 2))
    for index in range(MAX_DRAWS):
        sample = make_sample("retrieval", patches=patches, seed=seed, index=index, depth=0.5)
        if sample.answer == colour:
            return sample
    raise AssertionError(f"no {colour} flash in {MAX_DRAWS} samples")  # 1 in 8 has one


def write_needle_video(path: str | os.PathLike[str], colour: str, *, seconds: float = 40.0,
                       seed: int = 0) -> Path:
    """Write :func:`needle_sample_of`'s frames to ``path`` (its directories made); returns the
    path. The question to ask is :data:`apbv.synthetic.needles.QUESTIONS` ``["retrieval"]``."""
    return write_frames(path, needle_sample_of(colour, seconds, seed).frames)


def write_frames(path: str | os.PathLike[str], frames: Any, fps: float | None = None) -> Path:
    """Write uint8 ``frames`` (T, 3, H, W), RGB, at ``fps`` (default: the needles' 2 fps) to
    ``path`` (its directories made), nearly losslessly (x264 crf 0, yuv444p; mpeg4 yuv420p
    without x264) so that the noise stays noise; returns the path."""
    import av

    from apbv.synthetic.needles import FPS

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise ValueError(f"cannot create the directory of {str(path)!r}: a file is in the "
                         "way") from exc
    images = frames.permute(0, 2, 3, 1).numpy()  # (T, H, W, 3) uint8
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=int(fps or FPS))
        assert isinstance(stream, av.VideoStream), stream  # a video codec's stream
        stream.height, stream.width = images.shape[1:3]
        stream.pix_fmt = "yuv444p" if codec == "libx264" else "yuv420p"
        stream.codec_context.thread_count = 1  # the same bytes on every run
        if codec == "libx264":
            stream.options = {"crf": "0"}
        for image in images:
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
