"""A video's native frame size read from its container's header, before any frame is decoded.

Opening a file with a decoder decodes frames at their native size: the probe's truncation
check decodes the last one (:func:`apbv.video.probe`), and FFmpeg's stream analysis decodes
the first while it opens the file (decord and PyAV alike, measured: about 160 MB for one
8192x8192 frame). :func:`header_size` opens the container with PyAV and every stream's decoder
told to skip every frame (``skip_frame=all``), so the width and height come from the header
alone (about 5 MB for the same file); :func:`check_native_size` refuses a size over a limit
with a message naming the size and the limit.
"""

from __future__ import annotations

import os

from apbv.video.nofollow import fd_path, open_nofollow
from apbv.video.sampling import VideoSpec, _import

SKIP_DECODING = {"skip_frame": "all"}
"""Decoder options for the stream analysis of :func:`av.open`: no frame is decoded."""


def header_size(spec: VideoSpec) -> tuple[int, int] | None:
    """(height, width) of ``spec``'s video stream as its container's header gives them, without
    decoding a frame (a file opened as :func:`apbv.video.decoders._open` opens it: no link
    followed unless ``spec.follow_symlinks``); None when the header does not give a positive
    size or the file cannot be opened this way (the decoder's own open then checks the file
    and reports its error)."""
    av = _import("av", "av", "reading a video's header")
    fd = None
    try:
        if spec.follow_symlinks:
            source = spec.path
        else:
            fd = open_nofollow(spec.path, "video file")
            source = fd_path(fd)
        with av.open(source, options=SKIP_DECODING) as container:
            stream = container.streams.best("video")
            if stream is None:
                return None
            height, width = stream.codec_context.height, stream.codec_context.width
    except (ValueError, OSError, av.FFmpegError):
        return None
    finally:
        if fd is not None:
            os.close(fd)
    return (int(height), int(width)) if height > 0 and width > 0 else None


def check_native_size(spec: VideoSpec, max_pixels: int, flag: str) -> tuple[int, int] | None:
    """:func:`header_size` of ``spec``, checked by :func:`check_pixels`."""
    size = header_size(spec)
    if size is not None:
        check_pixels(size, max_pixels, flag)
    return size


def check_pixels(size: tuple[int, int], max_pixels: int, flag: str) -> None:
    """ValueError naming the native frame size (height, width) and the limit when the frames
    hold more than ``max_pixels`` pixels (``flag``: the setting that sets it)."""
    height, width = size
    if height * width > max_pixels:
        raise ValueError(f"the video's native frame size is {width}x{height} "
                         f"({height * width} pixels), over the limit of {max_pixels} pixels "
                         f"({flag})")
