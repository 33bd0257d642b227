"""A live source fed by its client: frames pushed from another thread (see
:mod:`apbv.capture.sources` for what a source is)."""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from apbv.capture.sources import RawFrame, Source
from apbv.validate import positive


class PushSource(Source):
    """Frames pushed by a client (another thread): :meth:`push`, then :meth:`end`.

    Pushing never blocks and never drops: frames wait here until the capture takes them (it
    does at once; its bounded buffer applies the drop policy). Pushed tensors and arrays are
    kept by reference, not copied: do not write into them after pushing.
    """

    def __init__(self, *, poll_s: float = 0.05) -> None:
        super().__init__()
        self.poll_s = positive("poll_s", poll_s, unit="seconds")
        self._queue: deque[RawFrame] = deque()
        self._cond = threading.Condition()
        self._ended = False
        self._last: float | None = None

    def push(self, frames: Any, timestamps: Sequence[float] | None = None, *,
             fps: float | None = None, layout: str | None = None) -> None:
        """Push uint8 ``frames``, (F, 3, H, W) or (F, H, W, 3) (torch or numpy; ``layout``
        "FCHW" / "FHWC" when both read the same, i.e. H or W is 3), with either
        ``timestamps`` (F seconds, strictly increasing and after every frame pushed before)
        or ``fps`` (frame i at last + (i + 1) / fps, the first frame ever at 0.0).
        ValueError for a bad shape, dtype, timestamps, or a push after :meth:`end`."""
        if isinstance(frames, torch.Tensor):
            tensor = frames
        else:
            try:
                tensor = torch.as_tensor(frames)
            except (TypeError, ValueError, RuntimeError) as err:
                raise ValueError(f"frames must be a uint8 tensor or array, got "
                                 f"{type(frames).__name__}") from err
        if tensor.dtype != torch.uint8 or tensor.dim() != 4:
            raise ValueError(f"frames must be uint8 (F, 3, H, W) or (F, H, W, 3), got "
                             f"{tensor.dtype} {tuple(tensor.shape)}")
        if layout not in (None, "FCHW", "FHWC"):
            raise ValueError(f"layout must be None, 'FCHW' or 'FHWC', got {layout!r}")
        first, last = tensor.shape[1] == 3, tensor.shape[-1] == 3
        if layout is None:
            if first and last:
                raise ValueError(f"frames of shape {tuple(tensor.shape)} read as both (F, 3, H, "
                                 "W) and (F, H, W, 3): give layout='FCHW' or 'FHWC'")
            if not (first or last):
                raise ValueError(f"frames must be (F, 3, H, W) or (F, H, W, 3), got "
                                 f"{tuple(tensor.shape)}")
            layout = "FCHW" if first else "FHWC"
        if layout == "FCHW":
            if not first:
                raise ValueError(f"FCHW frames need 3 channels, got {tuple(tensor.shape)}")
            tensor = tensor.permute(0, 2, 3, 1)
        elif not last:
            raise ValueError(f"FHWC frames need 3 channels, got {tuple(tensor.shape)}")
        count = tensor.shape[0]
        if (timestamps is None) == (fps is None):
            raise ValueError("give exactly one of timestamps and fps")
        rate = None if fps is None else positive("fps", fps, unit="frames per second")
        given = None if timestamps is None else [float(t) for t in timestamps]
        if given is not None:
            if len(given) != count:
                raise ValueError(f"{count} frames need {count} timestamps, got {len(given)}")
            if not all(math.isfinite(t) for t in given):
                raise ValueError(f"timestamps must be finite, got {given}")
        with self._cond:  # one pusher at a time: timestamps continue from the last push
            if self._ended:
                raise ValueError("push after end(): this source has ended")
            previous = self._last
            if rate is not None:
                start = 0.0 if previous is None else previous + 1.0 / rate
                times = [start + i / rate for i in range(count)]
            else:
                assert given is not None  # exactly one of timestamps and fps, checked above
                times = given
                chain = ([] if previous is None else [previous]) + times
                if any(b <= a for a, b in zip(chain, chain[1:])):
                    raise ValueError(f"timestamps must be strictly increasing and after the last "
                                     f"pushed one ({previous}), got {times}")
            self._queue.extend(zip(tensor.unbind(0), times))
            if times:
                self._last = times[-1]
            self._cond.notify_all()

    def end(self) -> None:
        """No more frames: the source ends once the capture has taken the pushed ones."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def frames(self, stop: threading.Event) -> Iterator[RawFrame | None]:
        while not stop.is_set():
            with self._cond:
                if not self._queue and not self._ended:
                    self._cond.wait(self.poll_s)
                item = self._queue.popleft() if self._queue else None
                if item is None and self._ended:
                    return
            yield item
