"""How a live stream ends, and what is told of it afterwards.

A stream ends for one of :data:`REASONS`: its client closed it (``closed``, ``DELETE``), it was
idle for ``--stream-idle-s`` (``idle``), the ranks of its replica were lost (``lost``), or the
server stopped (``server shutdown``). Its end is one ``stream.closed`` event
(:func:`closed_event`), the last one its event streams send before they end, and the last one
its watches' webhooks get. :class:`EndedStreams` remembers recently ended stream ids (at most
:data:`REMEMBERED` of them, each for :data:`REMEMBER_S` seconds): a later request on one is
answered with why it ended: 410 for ``idle`` and ``lost`` (the client did not end it), 404
naming the close for ``closed``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from apbv.openai.policy import ClientError

if TYPE_CHECKING:
    from apbv.serve.scheduler.replicas import Replica

REASONS = ("closed", "idle", "lost", "server shutdown")
"""Why a stream ended, as its ``stream.closed`` event says."""
REMEMBERED = 4096
"""Ended stream ids remembered at most (the oldest forgotten first)."""
REMEMBER_S = 3600.0
"""Seconds an ended stream id is remembered."""


@dataclass(frozen=True)
class Ending:
    """Why a stream ended (one of :data:`REASONS`) and the message that says so."""

    reason: str
    message: str
    at: float
    """When (monotonic s)."""

    def __post_init__(self) -> None:
        assert self.reason in REASONS, self.reason


def ending(stream_id: str, reason: str, detail: str = "") -> Ending:
    """The :class:`Ending` of ``stream_id`` for ``reason``; ``detail``: for ``lost``, what
    happened to its replica's ranks; for ``idle``, how long it was idle."""
    said = {
        "closed": "was closed by its client",
        "idle": f"was closed after {detail or 'its idle limit'} without use (--stream-idle-s)",
        "lost": f"was lost: {detail or 'a rank of its replica died'}",
        "server shutdown": "was closed: the server is shutting down",
    }[reason]
    tail = "" if reason == "closed" else "; open a new stream"
    return Ending(reason, f"stream {stream_id[:64]!r} {said}{tail}", time.monotonic())


def lost_detail(replica: Replica) -> str:
    """What a stream lost with ``replica``'s ranks is told (``lost``'s detail)."""
    return f"replica {replica.index}'s ranks were lost ({replica.last_loss}) and its group " \
        "is rebuilt"


def closed_event(stream_id: str, end: Ending, watches: list[str]) -> dict:
    """The ``stream.closed`` event of a stream that ended: its id, ``reason``, ``message``,
    the ids of the ``watches`` it held (each ended with it) and when (``created``, Unix s)."""
    return {"object": "stream.closed", "stream": stream_id, "reason": end.reason,
            "message": end.message, "watches": watches, "created": time.time()}


class EndedStreams:
    """Recently ended stream ids and why (bounded in count and age)."""

    def __init__(self, size: int = REMEMBERED, keep_s: float = REMEMBER_S):
        self.size, self.keep_s = size, keep_s
        self.ended: OrderedDict[str, Ending] = OrderedDict()

    def add(self, stream_id: str, end: Ending) -> None:
        self.ended[stream_id] = end
        self.ended.move_to_end(stream_id)
        self._trim()

    def _trim(self) -> None:
        old = time.monotonic() - self.keep_s
        while self.ended and (len(self.ended) > self.size or
                              next(iter(self.ended.values())).at < old):
            self.ended.popitem(last=False)

    def refusal(self, stream_id: str) -> ClientError | None:
        """The answer to a request on ``stream_id`` if it ended recently (410 naming why, or
        404 naming its close); None if it is not remembered."""
        self._trim()
        end = self.ended.get(stream_id)
        if end is None:
            return None
        if end.reason == "closed":
            return ClientError(404, f"no open stream {stream_id[:64]!r}: it was closed by its "
                                    "client")
        return ClientError(410, end.message)
