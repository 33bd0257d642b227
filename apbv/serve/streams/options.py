"""The options of a server's live streams (``--max-streams``, ``--stream-idle-s``,
``--stream-memory-gb``, ``--stream-end-after-s``; the served family's frame size rule and the
cost model their budgets use): :class:`StreamOptions`."""

from __future__ import annotations

from dataclasses import dataclass

from apbv.serve.streams import budget as stream_budget
from apbv.serve.streams import pricing as stream_time


@dataclass
class StreamOptions:
    budget_bytes: int
    """Per-rank KV bytes all streams of one replica may reserve (--stream-memory-gb)."""
    max_streams: int = 8
    idle_s: float = 600.0
    end_after_s: float | None = 10.0
    """A source ends after this long without news (--stream-end-after-s; None: never)."""
    sizing: stream_budget.KVSizing | None = None
    """The served family's frame size rule and reservations (None: the defaults' 14-pixel
    patches, and no stream may be placed)."""
    pricing: stream_time.StreamPricing | None = None
    """The cost model the time budget predicts with (None: only measured figures count, and
    a new stream is never refused for time)."""

    @property
    def family(self) -> stream_budget.KVSizing:
        """:attr:`sizing`, or the defaults' rule where none was given."""
        return self.sizing or stream_budget.KVSizing(0, 1, 1, 1)

    def frame_size(self, height: int, width: int, min_pixels: int | None,
                   max_pixels: int | None) -> tuple[int, int]:
        """:meth:`~apbv.serve.streams.budget.KVSizing.frame_size` of the served family."""
        return self.family.frame_size(height, width, min_pixels=min_pixels,
                                      max_pixels=max_pixels)
