"""What the server holds of standing questions (:mod:`apbv.serve.watches.routes`): a
:class:`Watch` (its question as a held-KV request, its rule's state, its counters) and a
stream's :class:`StreamWatches` (its watches, the chunks no evaluation saw yet, its
evaluation task), and the figures read from them: the lag of a stream's evaluation behind
capture (:func:`lag_s`) and a watch's share of its replica's time (:func:`share`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from apbv.serve.watches.events import Webhook
from apbv.watch.question import StandingQuestion

MAX_WATCHES = 8
"""Watches one stream may hold."""
WEBHOOK_FINISH_S = 30.0
"""Seconds a watch's webhook has to send its last events (its stream's end) once the watch
ended (:meth:`Watch.finish`); then its sender is stopped."""


@dataclass(eq=False, kw_only=True)
class Watch(StandingQuestion):
    """A standing question (:class:`apbv.watch.question.StandingQuestion`: the request, the
    rule and its state, when it is due) held by the server on one stream: its id, its webhook
    and the figures its GET and the replica's budget read."""

    id: str
    stream: str
    webhook: Webhook | None = None
    sender: asyncio.Task | None = None
    errors: int = 0
    error: str | None = None
    eval_s: float | None = None
    """Seconds of its last evaluation (queue wait excluded)."""
    predicted: tuple[float, float] | None = None
    """(Seconds of one evaluation as the cost model predicts it, scaled as
    :mod:`apbv.serve.streams.pricing` says; footage seconds between evaluations before its stream
    measured a chunk); None: not priced."""

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "stream": self.stream, "question": self.request.question,
                "choices": list(self.request.choices or ()), "every_s": self.every_s,
                "rule": {"kind": self.rule.kind, "choice": self.rule.choice,
                         "threshold": self.rule.threshold,
                         "hysteresis": self.rule.hysteresis, "hold": self.rule.hold},
                "answer": self.state.answer, "probs": self.last,
                "evaluations": self.evaluations, "reused": self.reused, "events": self.events,
                "errors": self.errors,
                "error": self.error, "last_timestamp": self.last_ts,
                "webhook": None if self.webhook is None else self.webhook.stats()}

    def stop(self) -> None:
        """Its webhook's sender ends (the watch was deleted, or its stream closed)."""
        if self.sender is not None:
            self.sender.cancel()

    def finish(self, event: dict[str, Any]) -> None:
        """Its stream ended: its webhook gets ``event`` after the events queued before it,
        then its sender ends (stopped after :data:`WEBHOOK_FINISH_S` at the latest)."""
        if self.webhook is None or self.sender is None or self.sender.done():
            return
        self.webhook.put(event)
        if self.webhook.finish():
            asyncio.get_running_loop().call_later(WEBHOOK_FINISH_S, self.sender.cancel)
        else:
            self.sender.cancel()


@dataclass(eq=False)
class StreamWatches:
    """One stream's watches and its evaluation task."""

    watches: dict[str, Watch] = field(default_factory=dict)
    pending: tuple[float, float] | None = None
    """(footage timestamp of the newest chunk, arrival of the oldest chunk not yet seen by an
    evaluation (monotonic s)); None: nothing new."""
    task: asyncio.Task | None = None
    running: float | None = None
    """Arrival of the oldest chunk the running evaluation round is the first to see."""
    coalesced: int = 0
    chunk_s: float | None = None
    """Footage seconds per appended chunk (the last one)."""
    last_ts: float | None = None


def lag_s(sw: StreamWatches) -> float:
    """Wall seconds the oldest chunk no evaluation has finished with has waited (0: none)."""
    oldest = sw.running if sw.running is not None else \
        None if sw.pending is None else sw.pending[1]
    return 0.0 if oldest is None else time.monotonic() - oldest


def share(watch: Watch, sw: StreamWatches) -> float:
    """The share of its replica's time ``watch`` takes: its last asked evaluation's seconds
    per footage seconds between its evaluations, times the share of its recent evaluations
    that were asked (not reused); before it was measured, its predicted seconds
    (:attr:`Watch.predicted`; 0 without one)."""
    period = watch.every_s or sw.chunk_s
    if watch.eval_s is not None and period:
        return watch.eval_s * watch.asked_share / period
    if watch.predicted is None:
        return 0.0
    seconds, chunk_s = watch.predicted
    return seconds / (period or chunk_s)
