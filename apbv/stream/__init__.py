"""Live video streams, capture side: sources of timestamped frames and a capture thread that
samples, resizes and buffers them for the model loop (see :mod:`apbv.stream.sources` and
:mod:`apbv.stream.capture`)."""

from apbv.stream.capture import DROP_POLICIES, Capture
from apbv.stream.push import PushSource
from apbv.stream.sources import (
    SEGMENT_EXTENSIONS,
    SEGMENT_ORDERS,
    FollowFile,
    Frame,
    SegmentDir,
    Source,
    UrlSource,
    local_source,
    stream_frame_size,
)

__all__ = [
    "DROP_POLICIES", "SEGMENT_EXTENSIONS", "SEGMENT_ORDERS", "Capture", "FollowFile", "Frame",
    "PushSource", "SegmentDir", "Source", "UrlSource", "local_source",
    "stream_frame_size",
]
