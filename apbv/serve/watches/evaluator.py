"""The evaluation of standing questions (:mod:`apbv.serve.watches.routes`) as footage arrives.

A watch is asked again over the stream's held KV (a :class:`~apbv.serve.ranks.ops.Generate` of its
``StreamRef`` request in mode ``exact``, through the replica's queue like any stream
operation) after every appended chunk, or once every ``every_s`` seconds of footage; its event
rule (:mod:`apbv.watch.rules`) turns the choices' probabilities into events, published to
the event streams (:class:`apbv.serve.watches.events.EventHub`), the watch's webhook, the server log
and Prometheus.

One task per stream evaluates its watches, one evaluation at a time: a chunk that lands while
one runs does not queue another behind it; the next evaluation takes the newest state, and
every chunk folded into it so is counted (``coalesced``). An event's ``footage_ts`` is the
timestamp of the last frame the evaluation saw; ``capture_to_event_s`` runs from the arrival
of the oldest chunk the evaluation was the first to see (so a coalesced chunk's wait counts);
its ``stages`` split that time: the newest chunk's append (seconds queued, seconds on the
ranks) and the evaluation's (the same), the rest being the wait for the stream's earlier
evaluations (``coalesced`` chunks) and the round's other watches.

An evaluation's job carries the arrival of its oldest chunk (``Job.evaluates``): the
replica's queue runs it before other work (:mod:`apbv.serve.scheduler.fair_order`).

A watch whose stream gained no tokens since its last evaluation was asked (temporal pruning
kept none of the new patches) is not asked again: that evaluation's answer is reused (no job;
``reused``, ``apbv:watch_reused_total``) and its rule still folds it in, as
:class:`apbv.watch.question.StandingQuestion` rules.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import TYPE_CHECKING

from apbv.serve.ranks.ops import Generate
from apbv.serve.streams.registry import LiveStream, StreamRegistry
from apbv.serve.watches.events import EventHub
from apbv.serve.watches.state import StreamWatches, Watch

if TYPE_CHECKING:
    from apbv.serve.front.metrics import Metrics
    from apbv.watch.rules import Change

log = logging.getLogger("apbv.serve")


class Evaluator:
    """Evaluates the watches of ``of`` (stream id -> its watches) on ``registry``'s streams;
    events go to ``hub``; figures to the server's ``metrics``."""

    def __init__(self, registry: StreamRegistry, of: dict[str, StreamWatches], hub: EventHub,
                 metrics: Metrics):
        self.registry, self.of, self.hub = registry, of, hub
        self.events_total, self.latency = metrics.watch_events, metrics.capture_to_event
        self.evaluations, self.coalesced = metrics.watch_evaluations, metrics.watch_coalesced
        self.dropped = metrics.events_dropped
        self.reused = metrics.watch_reused

    def appended(self, live: LiveStream, footage_ts: float, arrived: float,
                 chunk_s: float) -> None:
        """A chunk (its last frame at ``footage_ts``, arrived at ``arrived`` monotonic s,
        ``chunk_s`` seconds of footage) is held: evaluate the stream's due watches on it, or
        fold it into the evaluation after the running one."""
        sw = self.of.get(live.id)
        if sw is None or not sw.watches:
            return
        sw.chunk_s = chunk_s
        self.schedule(live, sw, footage_ts, arrived)

    def schedule(self, live: LiveStream, sw: StreamWatches, footage_ts: float,
                 arrived: float) -> None:
        """Evaluate ``sw`` on the state whose last frame is at ``footage_ts`` (its oldest
        unseen chunk arrived at ``arrived``): now, or after the running round, coalesced."""
        if sw.pending is not None:  # no evaluation saw the previous chunk: folded in
            sw.coalesced += 1
            self.coalesced.inc()
            arrived = sw.pending[1]
        sw.pending = (footage_ts, arrived)
        if sw.task is None or sw.task.done():  # in a context of its own: no request's id
            sw.task = asyncio.get_running_loop().create_task(self._evaluate(live, sw),
                                                             context=contextvars.Context())

    async def _evaluate(self, live: LiveStream, sw: StreamWatches) -> None:
        """Evaluate the due watches on the newest state, again while chunks came meanwhile."""
        try:
            while sw.pending is not None:
                footage_ts, arrived = sw.pending
                sw.pending, sw.running = None, arrived
                await self._round(live, sw, footage_ts, arrived)
        finally:
            sw.running = None

    async def _round(self, live: LiveStream, sw: StreamWatches, footage_ts: float,
                     arrived: float) -> None:
        """One evaluation of each due watch on the state whose last frame is at
        ``footage_ts``."""
        sw.last_ts = footage_ts
        appended = live.append_s
        for watch in [w for w in sw.watches.values() if w.due(footage_ts)]:
            if live.closing or self.registry.live.get(live.id) is not live:
                return
            stages: dict[str, float | bool | None] = {
                "append_wait_s": None if appended is None else appended[0],
                "append_s": None if appended is None else appended[1]}
            if watch.reuses(live.recent.tokens):
                self.reused.inc()
                self._judge(watch, watch.reuse(footage_ts), None, arrived,
                            {**stages, "eval_wait_s": 0.0, "eval_s": 0.0, "reused": True})
                continue
            seen, start = live.recent.tokens, time.monotonic()
            try:
                result, wait = await self.registry.run(live, Generate(watch.request),
                                                       evaluates=arrived)
            except Exception as exc:  # noqa: BLE001  # kept on the watch for GET
                watch.errors += 1
                watch.error = f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"
                continue
            watch.eval_s = time.monotonic() - start - wait
            if sw.watches.get(watch.id) is not watch:
                continue  # deleted meanwhile
            self._judge(watch, watch.fold(result, footage_ts, seen), result.ttft_s, arrived,
                        {**stages, "eval_wait_s": wait, "eval_s": watch.eval_s})

    def _judge(self, watch: Watch, change: Change | None, ttft_s: float | None,
               arrived: float, stages: dict[str, float | bool | None]) -> None:
        """Count an evaluation folded into ``watch``'s rule (:meth:`Watch.fold` or
        :meth:`Watch.reuse`: ``ttft_s`` None); publish the ``change`` it made, if any
        (``stages``: the seconds its latency is made of, see the module docstring)."""
        watch.error = None
        self.evaluations.inc()
        if change is None:
            return
        latency = time.monotonic() - arrived
        event = {"object": "watch.event", "watch": watch.id, "stream": watch.stream,
                 **watch.event(change), "rule": watch.rule.kind, "choice": watch.rule.choice,
                 "capture_to_event_s": latency, "ttft_s": ttft_s, "stages": stages,
                 "evaluation": watch.evaluations, "created": time.time()}
        self.events_total.inc()
        self.latency.observe(latency)
        before = self.hub.dropped
        self.hub.publish(event)
        if watch.webhook is not None:
            before -= watch.webhook.dropped
            watch.webhook.put(event)
            before += watch.webhook.dropped
        self.dropped.inc(self.hub.dropped - before)
        log.info("watch %s on %s: %r -> %r at %.2f s of footage (%.3f s after arrival, %s)",
                 watch.id, watch.stream, change.previous, change.answer, watch.last_ts, latency,
                 "the previous answer reused" if ttft_s is None else f"TTFT {ttft_s:.3f} s")
