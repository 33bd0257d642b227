"""Live video streams, capture side: sources of timestamped frames and a capture thread that
samples, resizes and buffers them for the model loop (see :mod:`apbv.capture.sources`,
:mod:`apbv.capture.files` and :mod:`apbv.capture.capture`)."""

from apbv.capture.capture import DROP_POLICIES, Capture
from apbv.capture.files import (
    SEGMENT_EXTENSIONS,
    SEGMENT_ORDERS,
    FollowFile,
    SegmentDir,
    local_source,
)
from apbv.capture.push import PushSource
from apbv.capture.sources import Frame, Source, UrlSource
from apbv.video.sampling import stream_frame_size

__all__ = [
    "DROP_POLICIES", "SEGMENT_EXTENSIONS", "SEGMENT_ORDERS", "Capture", "FollowFile", "Frame",
    "PushSource", "SegmentDir", "Source", "UrlSource", "local_source",
    "stream_frame_size",
]
