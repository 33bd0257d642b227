"""What the stream registry tells the room above it (the watches), as a Protocol the registry
takes at construction: no hook is set on it afterwards, and no import runs upward. Generic in
the stream's record (the registry's ``LiveStream``), so this module imports no registry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from apbv.serve.scheduler.replicas import Replica
    from apbv.serve.streams.end import Ending

LiveStream = TypeVar("LiveStream", contravariant=True)
"""A stream as the registry holds it."""


class StreamListener(Protocol[LiveStream]):
    """Told of every append and every end of a stream; asked how much of a replica's time it
    takes and what a stream's GET shows of it."""

    def appended(self, live: LiveStream, last_ts: float, arrived: float,
                 footage_s: float) -> None:
        """After each append: the stream, its last frame's timestamp, when the frames arrived
        (monotonic s), their seconds of footage."""

    def forget(self, live: LiveStream, end: Ending | None) -> None:
        """The stream was closed or lost, with how it ended (None: it never was handed to a
        client)."""

    def replica_load(self, replica: Replica) -> float:
        """The share of ``replica``'s time it takes (seconds per second)."""

    def stats(self, live: LiveStream) -> dict[str, object]:
        """What a stream's GET shows of it."""


class NoListener(Generic[LiveStream]):
    """The listener of a registry that nothing listens to."""

    def appended(self, live: LiveStream, last_ts: float, arrived: float,
                 footage_s: float) -> None:
        return None

    def forget(self, live: LiveStream, end: Ending | None) -> None:
        return None

    def replica_load(self, replica: Replica) -> float:
        return 0.0

    def stats(self, live: LiveStream) -> dict[str, object]:
        return {"count": 0}
