"""Capture: a source decoded, sampled and resized in its own thread, into a bounded buffer.

The model loop never waits for the source and the source never waits for the model: the
capture thread takes every native frame from the source, keeps those that fall on the stream's
sample times, resizes them to the stream's fixed frame size and appends them to a buffer of at
most ``capacity`` frames; the consumer calls :meth:`Capture.take`. When the consumer falls
behind and the buffer is full, frames are dropped by the declared policy and counted.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import torch

from apbv.capture.sources import Frame, Source, _error_text
from apbv.validate import positive
from apbv.video.load import resize_frames
from apbv.video.sampling import stream_frame_size

DROP_POLICIES = ("newest", "every_k")
"""How a full buffer makes room; see :class:`Capture`."""


class _Sampler:
    """Keeps a frame when its timestamp reaches the next sample time t0 + n / fps (t0: the
    first frame's timestamp); after a kept frame at t, n becomes the smallest with
    t0 + n / fps > t, so a gap in the source never produces a burst. fps None keeps all."""

    def __init__(self, fps: float | None) -> None:
        self.fps = fps
        self._t0: float | None = None
        self._n = 0

    def keep(self, t: float) -> bool:
        if self.fps is None:
            return True
        if self._t0 is None:
            self._t0, self._n = t, 1
            return True
        if t < self._t0 + self._n / self.fps - 1e-9:
            return False
        self._n = math.floor((t - self._t0) * self.fps + 1e-9) + 1
        return True


class Capture:
    """Runs ``source`` in a daemon thread (started at construction) and buffers its frames.

    Sampling: with ``fps``, a native frame is kept when its timestamp reaches the next sample
    time t0 + n / fps (t0: the first frame's); None keeps every frame. Kept frames are resized
    to ``size`` (h, w) or, when None, to :func:`stream_frame_size` of the first frame's native
    size with ``min_pixels`` / ``max_pixels`` and the family's ``image_patch_size`` (sides
    multiples of twice it), with the one-shot path's resize (torchvision bicubic, antialias, on
    the uint8 frame): :class:`Frame` images are uint8 (3, h, w).

    Drop policy (when a kept frame arrives and the buffer already holds ``capacity`` frames):

    - ``"newest"``: the oldest buffered frame is dropped; the buffer always holds the newest
      ``capacity`` frames.
    - ``"every_k"``: the buffer is thinned to every ``k``-th of its frames, counted from the
      oldest (positions 0, k, 2k, ...), then the new frame is appended. The buffer keeps
      spanning the whole backlog at a lower frame rate, the older part the sparser, the longer
      the consumer stays behind.

    Every dropped frame is counted in ``frames_dropped``. :meth:`stats` has the keys:

    - ``frames_decoded``: native frames the source produced; ``frames_sampled``: those kept by
      the fps sampling (and resized); ``frames_dropped``: removed by the drop policy;
      ``frames_delivered``: returned by :meth:`take`; ``buffered``: waiting in the buffer
      (sampled = dropped + delivered + buffered).
    - ``ingest_lag_s``: source seconds the consumer is behind: newest sampled timestamp minus
      newest delivered one (minus the first sampled one before any delivery; 0.0 before any
      frame).
    - ``idle_s``: wall seconds since the source last produced a frame (since the start before
      the first one); ``stalled``: idle_s > ``stall_s`` while not ended.
    - ``ended``: no frame will be added any more (the source ended, failed, was given up on,
      or :meth:`close` was called); buffered frames can still be taken. ``closed``: close()
      was called. ``error``: why the capture stopped early (the source's error, or a stall
      longer than ``give_up_s``), else None.
    - ``segments_done``, ``segments_failed``: segments decoded / skipped as corrupt (segment
      sources; 0 otherwise); ``errors``: short strings, the source's (e.g. "name: error" per
      failed segment) and the capture's.

    A stall longer than ``give_up_s`` (None: never) ends the capture with an error naming it;
    it is checked by the thread and by every :meth:`stats` / :meth:`take` call, so it holds
    even while the source is blocked inside a decoder call.
    """

    def __init__(self, source: Source, *, fps: float | None = None,
                 size: tuple[int, int] | None = None, min_pixels: int | None = None,
                 max_pixels: int | None = None, capacity: int = 64, drop: str = "newest",
                 k: int = 2, stall_s: float = 2.0, give_up_s: float | None = None,
                 image_patch_size: int = 14) -> None:
        if not isinstance(source, Source):
            raise ValueError(f"source must be an apbv.capture Source, got "
                             f"{type(source).__name__}")
        self.fps = None if fps is None else positive("fps", fps, unit="frames per second")
        if size is not None:
            if not (isinstance(size, tuple) and len(size) == 2 and all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in size)):
                raise ValueError(f"size must be None or a (height, width) tuple of positive "
                                 f"ints, got {size!r}")
        elif min_pixels is not None or max_pixels is not None:
            stream_frame_size(28, 28, min_pixels=min_pixels, max_pixels=max_pixels,
                              image_patch_size=image_patch_size)  # checks
        if drop not in DROP_POLICIES:
            raise ValueError(f"drop must be one of {DROP_POLICIES}, got {drop!r}")
        for name, value, low in (("capacity", capacity, 1), ("k", k, 2)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if drop == "every_k" and capacity < 2:
            raise ValueError(f"drop='every_k' needs capacity >= 2, got {capacity}")
        self.stall_s = positive("stall_s", stall_s, unit="seconds")
        self.give_up_s = positive("give_up_s", give_up_s, allow_none=True, unit="seconds")
        self.source = source
        self.frame_size = size
        self._pixels = (min_pixels, max_pixels)
        self._patch = image_patch_size
        self.capacity, self.drop, self.k = capacity, drop, k
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._buffer: list[Frame] = []
        self._counts = dict.fromkeys(("decoded", "sampled", "dropped", "delivered"), 0)
        self._first_sampled: float | None = None
        self._newest_sampled: float | None = None
        self._newest_delivered: float | None = None
        self._ended = False
        self._closed = False
        self._error: str | None = None
        self._errors: list[str] = []
        self._last_progress = time.monotonic()
        self._sampler = _Sampler(self.fps)
        self._thread = threading.Thread(target=self._run, name="apbv-capture", daemon=True)
        self._thread.start()

    # -- the capture thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            for item in self.source.frames(self._stop):
                if self._stop.is_set():
                    break
                if item is None:
                    self._check_give_up()
                    continue
                image, timestamp = item
                with self._cond:
                    if self._ended:
                        break
                    self._counts["decoded"] += 1
                    self._last_progress = time.monotonic()
                if not self._sampler.keep(timestamp):
                    continue
                frame = Frame(self._resize(image), float(timestamp))
                self._add(frame)
        except Exception as err:
            self._finish(_error_text(err))
        else:
            self._finish(None)

    def _resize(self, image: torch.Tensor) -> torch.Tensor:
        """uint8 (H, W, 3) -> uint8 (3, h, w) at the stream's frame size."""
        if self.frame_size is None:
            min_pixels, max_pixels = self._pixels
            self.frame_size = stream_frame_size(int(image.shape[0]), int(image.shape[1]),
                                                min_pixels=min_pixels, max_pixels=max_pixels,
                                                image_patch_size=self._patch)
        chw = image.permute(2, 0, 1).unsqueeze(0)  # channels-last strides, as the one-shot path
        return resize_frames(chw, self.frame_size)[0]

    def _add(self, frame: Frame) -> None:
        with self._cond:
            if self._ended:
                return
            self._counts["sampled"] += 1
            if self._first_sampled is None:
                self._first_sampled = frame.timestamp
            self._newest_sampled = frame.timestamp
            if len(self._buffer) >= self.capacity:
                before = len(self._buffer)
                if self.drop == "newest":
                    self._buffer = self._buffer[before - self.capacity + 1:]
                else:
                    self._buffer = self._buffer[::self.k]
                self._counts["dropped"] += before - len(self._buffer)
            self._buffer.append(frame)
            self._cond.notify_all()

    def _finish(self, error: str | None) -> None:
        with self._cond:
            if not self._ended:
                self._ended = True
                self._error = error
                if error is not None:
                    self._errors.append(error)
            self._cond.notify_all()

    def _check_give_up(self) -> None:
        if self.give_up_s is None:
            return
        with self._cond:
            idle = time.monotonic() - self._last_progress
            if self._ended or idle < self.give_up_s:
                return
        self._stop.set()
        self._finish(f"source stalled: no frame for {idle:.2f} s (give_up_s={self.give_up_s})")

    # -- the consumer ------------------------------------------------------------------------

    def take(self, max_frames: int | None = None, *, timeout: float | None = None
             ) -> list[Frame]:
        """The oldest buffered frames, at most ``max_frames`` (None: all), oldest first.

        Without ``timeout`` it never waits (maybe []). With ``timeout`` seconds it waits until a
        frame is buffered, the capture has ended, or the timeout passes; after the end and
        with nothing buffered it returns [] at once.
        """
        if max_frames is not None and (isinstance(max_frames, bool) or not isinstance(
                max_frames, int) or max_frames < 1):
            raise ValueError(f"max_frames must be None or an integer >= 1, got {max_frames!r}")
        wait = positive("timeout", timeout, allow_none=True, allow_zero=True, unit="seconds")
        deadline = None if wait is None else time.monotonic() + wait
        self._check_give_up()
        with self._cond:
            while deadline is not None and not self._buffer and not self._ended:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                # Short waits: the give-up check must run even while the source is blocked.
                self._cond.wait(min(left, 0.05) if self.give_up_s is not None else left)
                if self.give_up_s is not None:
                    self._cond.release()
                    try:
                        self._check_give_up()
                    finally:
                        self._cond.acquire()
            count = len(self._buffer) if max_frames is None else min(max_frames,
                                                                     len(self._buffer))
            out, self._buffer = self._buffer[:count], self._buffer[count:]
            self._counts["delivered"] += count
            if out:
                self._newest_delivered = out[-1].timestamp
            return out

    def stats(self) -> dict[str, Any]:
        """The capture's counters and state; the keys are listed in :class:`Capture`."""
        self._check_give_up()
        with self._cond:
            idle = time.monotonic() - self._last_progress
            newest = self._newest_sampled
            behind = self._newest_delivered if self._newest_delivered is not None \
                else self._first_sampled
            return {
                "frames_decoded": self._counts["decoded"],
                "frames_sampled": self._counts["sampled"],
                "frames_dropped": self._counts["dropped"],
                "frames_delivered": self._counts["delivered"],
                "buffered": len(self._buffer),
                "ingest_lag_s": 0.0 if newest is None or behind is None else newest - behind,
                "idle_s": idle,
                "stalled": not self._ended and idle > self.stall_s,
                "ended": self._ended,
                "closed": self._closed,
                "error": self._error,
                "segments_done": self.source.segments_done,
                "segments_failed": self.source.segments_failed,
                "errors": list(self.source.errors) + list(self._errors),
            }

    def close(self, join_s: float = 1.0) -> None:
        """Stop capturing: no frame is added after this returns; the thread is joined for at
        most ``join_s`` seconds (a source blocked inside a decoder call finishes that call on
        its own, in a daemon thread that holds nothing of the consumer's)."""
        wait = positive("join_s", join_s, allow_zero=True, unit="seconds")
        self._stop.set()
        with self._cond:
            self._closed = True
            self._ended = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(wait)

    def __enter__(self) -> Capture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
