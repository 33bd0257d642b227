"""Videos of large native frames, made cheaply: solid yuv420p planes encoded by libx264 at its
fastest preset and lowest quality (one 8192x8192 frame: about 0.25 MB, in about a second)."""

from __future__ import annotations

from pathlib import Path


def write_large_frame_video(path: Path, width: int, height: int, frames: int = 1) -> Path:
    """``frames`` solid frames of ``width`` x ``height`` at 4 fps in ``path``; returns it."""
    import av
    import numpy as np

    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=4)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.thread_count = 1
        if codec == "libx264":
            stream.options = {"crf": "51", "preset": "ultrafast"}
        for i in range(frames):
            frame = av.VideoFrame(width, height, "yuv420p")
            for plane, value in zip(frame.planes, (60 + 50 * i, 128, 128), strict=True):
                plane.update(np.full(plane.buffer_size, value % 256, np.uint8))
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
