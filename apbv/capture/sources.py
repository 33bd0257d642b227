"""Live video sources: native decoded frames with timestamps, for :class:`~apbv.capture.Capture`.

A source is an object with ``frames(stop)``: an iterator of ``(image, timestamp)`` items, where
``image`` is uint8 (H, W, 3) RGB at the source's native size and ``timestamp`` is seconds on the
source's clock, strictly increasing; it may also yield ``None``, "nothing new yet", so the caller
can look at its stop event and clocks while the source waits. The iterator returns when the
source ends and raises when it fails; it returns soon after ``stop`` (a ``threading.Event``) is
set, except while blocked inside the decoder (a network read: bounded by the read timeout).
Every source also keeps ``segments_done``, ``segments_failed`` and ``errors`` (short strings) for
the capture's stats.

- :class:`~apbv.capture.files.FollowFile` (in :mod:`apbv.capture.files`): a file that is still
  being written (``tail -f``).
- :class:`~apbv.capture.files.SegmentDir` (there too): a directory of segment files as a
  recorder writes them.
- :class:`UrlSource`: anything PyAV (FFmpeg) opens: rtsp://, http(s)://, a local file.
- :class:`~apbv.capture.push.PushSource` (its own module): frames pushed by a client.

File and URL timestamps are ``frame.time`` minus the first decoded frame's, so every source
starts at 0.0 (segments continue where the previous one ended). PyAV is imported only when a
file or URL is opened.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from apbv.validate import positive
from apbv.video.sampling import _import

RawFrame = tuple[torch.Tensor, float]
"""What a source yields: (uint8 (H, W, 3) RGB at the native size, timestamp in seconds)."""



@dataclass(frozen=True)
class Frame:
    """One captured frame, ready for the model."""

    image: torch.Tensor
    """uint8 (3, H, W) RGB, already resized to the stream's frame size."""
    timestamp: float
    """Seconds on the source's clock (0.0 at the first frame of a file, segment dir or URL)."""


def _error_text(err: BaseException) -> str:
    """A short message: ValueErrors as they are, others with their type; an FFmpeg/OS error
    without the file name it repeats."""
    reason = getattr(err, "strerror", None)  # FFmpeg and OS errors
    if reason:
        return f"{type(err).__name__}: {reason}"
    return str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"


class Source:
    """Base of the sources: counters for the stats, and the ``frames(stop)`` protocol."""

    def __init__(self) -> None:
        self.segments_done = 0
        self.segments_failed = 0
        self.errors: list[str] = []

    def frames(self, stop: threading.Event) -> Iterator[RawFrame | None]:
        raise NotImplementedError

    def probe(self) -> None:
        """ValueError when the source cannot give video (a quick look, before any frame is
        taken; the server calls it when a stream opens). This base: nothing to look at."""


def _decode(container: Any, stop: threading.Event, where: str) -> Iterator[tuple[Any, float]]:
    """(numpy uint8 (H, W, 3), frame.time in seconds) of the first video stream of an open
    PyAV container, in presentation order; returns early once ``stop`` is set."""
    if not container.streams.video:
        raise ValueError(f"{where} has no video stream")
    stream = container.streams.video[0]
    # Slice threads only: frame threads would hold back one frame per thread (latency).
    stream.thread_type = "SLICE"
    step = _frame_step(container)
    last: float | None = None
    for packet in container.demux(stream):
        if stop.is_set():
            return
        for frame in packet.decode():
            if frame.time is not None:
                t = float(frame.time)
            else:  # no timestamp: one frame period after the previous one
                t = 0.0 if last is None else last + step
            last = t
            yield frame.to_ndarray(format="rgb24"), t


def _from_start(container: Any, stop: threading.Event, where: str) -> Iterator[RawFrame]:
    """:func:`_decode`'s frames as tensors, their times counted from the first frame's."""
    origin: float | None = None
    for image, t in _decode(container, stop, where):
        origin = t if origin is None else origin
        yield torch.from_numpy(image), t - origin


def _frame_step(container: Any) -> float:
    """One frame period of the container's first video stream in seconds (0.0: unknown)."""
    stream = container.streams.video[0]
    rate = stream.average_rate or stream.guessed_rate
    return 1.0 / float(rate) if rate else 0.0


class UrlSource(Source):
    """Whatever PyAV (FFmpeg) opens: ``rtsp://``, ``http(s)://`` (an HLS playlist, a TS or
    fMP4 stream), a local file. Ends when the stream ends.

    ``open_timeout_s`` bounds connecting and ``read_timeout_s`` each read (FFmpeg's own
    timeouts), so a dead or stalled server raises instead of hanging; a URL that cannot be
    opened raises ValueError naming it (the capture reports it in its stats).
    """

    def __init__(self, url: str, *, open_timeout_s: float = 10.0, read_timeout_s: float = 10.0,
                 options: dict[str, str] | None = None) -> None:
        super().__init__()
        if not isinstance(url, str) or not url:
            raise ValueError(f"url must be a non-empty str, got {url!r}")
        self.url = url
        self.open_timeout_s = positive("open_timeout_s", open_timeout_s, unit="seconds")
        self.read_timeout_s = positive("read_timeout_s", read_timeout_s, unit="seconds")
        self.options = dict(options or {})

    def frames(self, stop: threading.Event) -> Iterator[RawFrame | None]:
        av = _import("av", "av", "opening a video URL")
        try:
            container = av.open(self.url, options=self.options,
                                timeout=(self.open_timeout_s, self.read_timeout_s))
        except (av.FFmpegError, OSError) as err:
            raise ValueError(f"video URL {self.url!r} cannot be opened by PyAV: {err}") from err
        with container:
            try:
                yield from _from_start(container, stop, f"video URL {self.url!r}")
            except av.FFmpegError as err:
                raise ValueError(f"video URL {self.url!r} failed while reading: {err}") from err
