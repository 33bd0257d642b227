"""Standing questions on live streams (``/v1/streams/{id}/watches``) and their events
(``/v1/events``, ``/v1/streams/{id}/events``): the routes, the replica's budget of watches and
a stream's watch figures.

A watch's body is checked by :mod:`apbv.serve.watches.body`, what is held of it is
:mod:`apbv.serve.watches.state`, its evaluation as footage arrives (coalesced, its events
published) is :mod:`apbv.serve.watches.evaluator`.

A new watch is refused (429) when the replica's streams would need more than its whole time:
each watch costs its evaluation seconds per its stream's footage seconds between evaluations
(:meth:`Watches.load`), measured once evaluated, predicted by the cost model before
(:mod:`apbv.serve.streams.pricing`), on top of the streams' appends; the figures are in the
message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from apbv.openai.policy import ClientError
from apbv.serve.front.front import Front
from apbv.serve.streams.end import Ending, closed_event
from apbv.serve.streams.registry import LiveStream, StreamRegistry
from apbv.serve.watches.body import parse_watch
from apbv.serve.watches.evaluator import Evaluator
from apbv.serve.watches.events import EventHub
from apbv.serve.watches.state import MAX_WATCHES, StreamWatches, Watch, lag_s, share

if TYPE_CHECKING:
    from apbv.serve.scheduler.replicas import Replica

__all__ = ["MAX_WATCHES", "StreamWatches", "Watch", "Watches", "lag_s"]

log = logging.getLogger("apbv.serve")


class Watches:
    """The watches of one server's streams, their event streams and metrics: the
    ``registry``'s listener (:class:`~apbv.serve.streams.listener.StreamListener`, which it
    makes at its construction)."""

    def __init__(self, front: Front, registry: StreamRegistry):
        self.front, self.registry = front, registry
        self.of: dict[str, StreamWatches] = {}
        self.hub = EventHub()
        self.finishing: set[asyncio.Task] = set()
        """The webhook senders of watches whose stream ended (sending its last events)."""
        self.evaluator = Evaluator(self.registry, self.of, self.hub, front.metrics)

    def appended(self, live: LiveStream, last_ts: float, arrived: float,
                 footage_s: float) -> None:
        """Frames were appended to ``live``: its watches are evaluated when due."""
        self.evaluator.appended(live, last_ts, arrived, footage_s)

    # --- the routes -------------------------------------------------------------------------

    async def create(self, stream_id: str, request: Request) -> JSONResponse:
        self.front.authorize(request)
        live = self.registry.get(stream_id)
        body = await self.front.read_json(request)
        watch = parse_watch(self.front, live.id, body)
        sw = self.of.setdefault(live.id, StreamWatches())
        if len(sw.watches) >= MAX_WATCHES:
            raise ClientError(429, f"stream {live.id!r} holds {len(sw.watches)} watches, the "
                                   f"limit is {MAX_WATCHES}: delete one first")
        watch.predicted = self.predict(live, watch)
        self._check_budget(live, watch)
        if watch.webhook is not None:
            watch.sender = asyncio.ensure_future(watch.webhook.run())
        sw.watches[watch.id] = watch
        log.info("watch %s on %s: %r, choices %s, rule %s", watch.id, live.id,
                 watch.request.question[:80], list(watch.request.choices or ()), watch.rule.kind)
        if live.last_ts is not None and sw.pending is None:  # its baseline now (a pending
            self.evaluator.schedule(live, sw, live.last_ts,  # round takes it in)
                                    time.monotonic())
        return JSONResponse(watch.describe(), status_code=201)

    async def list_watches(self, stream_id: str, request: Request) -> JSONResponse:
        self.front.authorize(request)
        live = self.registry.get(stream_id)
        sw = self.of.get(live.id, StreamWatches())
        return JSONResponse({"stream": live.id, "object": "list",
                             "data": [w.describe() for w in sw.watches.values()]})

    async def delete(self, stream_id: str, watch_id: str, request: Request) -> JSONResponse:
        self.front.authorize(request)
        live = self.registry.get(stream_id)
        watch = self.of.get(live.id, StreamWatches()).watches.pop(watch_id, None)
        if watch is None:
            raise ClientError(404, f"no watch {watch_id[:64]!r} on stream {live.id!r}")
        watch.stop()
        return JSONResponse({"id": watch.id, "deleted": True})

    async def events(self, request: Request) -> StreamingResponse:
        """Every stream's events; ``?stream=ID`` and ``?watch=ID`` filter them."""
        self.front.authorize(request)
        stream, watch = request.query_params.get("stream"), request.query_params.get("watch")
        ended = None if stream is None else self.registry.ended.refusal(stream)
        if ended is not None:  # it would never send anything
            raise ended
        return self._subscribe(stream, watch, request)

    async def stream_events(self, stream_id: str, request: Request) -> StreamingResponse:
        self.front.authorize(request)
        live = self.registry.get(stream_id)
        return self._subscribe(live.id, request.query_params.get("watch"), request)

    def _subscribe(self, stream: str | None, watch: str | None,
                   request: Request) -> StreamingResponse:
        sub = self.hub.subscribe(stream, watch,
                                 request.client.host if request.client is not None else None)
        return StreamingResponse(self.hub.stream(sub), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def register(self, app: FastAPI) -> None:
        app.post("/v1/streams/{stream_id}/watches")(self.create)
        app.get("/v1/streams/{stream_id}/watches")(self.list_watches)
        app.delete("/v1/streams/{stream_id}/watches/{watch_id}")(self.delete)
        app.get("/v1/streams/{stream_id}/events")(self.stream_events)
        app.get("/v1/events")(self.events)

    # --- budget and stats -------------------------------------------------------------------

    def load(self, live: LiveStream) -> float:
        """The share of ``live``'s replica's time its watches take (:meth:`replica_load`)."""
        return self.replica_load(live.replica)

    def replica_load(self, replica: Replica) -> float:
        """The share of ``replica``'s time its watches take: evaluation seconds per footage
        seconds between evaluations, summed over the watches measured so far."""
        total = 0.0
        for stream_id, sw in self.of.items():
            other = self.registry.live.get(stream_id)
            if other is None or other.replica is not replica:
                continue
            total += sum(share(w, sw) for w in sw.watches.values())
        return total

    def predict(self, live: LiveStream, watch: Watch) -> tuple[float, float] | None:
        """:attr:`Watch.predicted` of ``watch`` on ``live``: the cost model's seconds of its
        ask x the replica's scale, and the footage seconds of an append as priced; None
        without a cost model."""
        ask, pricing = watch.request, self.registry.opt.pricing
        cost = self.registry.price(live.spec, live.sized, live.pixels[1], ask.question,
                                   ask.choices or ())
        if cost is None or pricing is None:
            return None
        return (cost.ask_s * self.registry.appends(live.replica)[1],
                pricing.chunk_frames / live.spec.fps)

    def _check_budget(self, live: LiveStream, watch: Watch) -> None:
        sw = self.of[live.id]
        measured = [w.eval_s for w in sw.watches.values() if w.eval_s is not None]
        period = watch.every_s or sw.chunk_s
        if measured and period:
            seconds, how = max(measured), "measured on this stream"
        elif watch.predicted is not None:  # nothing measured yet: the cost model's
            seconds, how = watch.predicted[0], "predicted"
            period = period or watch.predicted[1]
        else:
            return  # neither measured nor priced: admitted
        need, held = seconds / period, self.load(live)
        appends = self.registry.appends(live.replica)[0]
        if held + appends + need > 1.0:
            raise ClientError(429, f"replica {live.replica.index} cannot sustain this watch: "
                                   f"it needs about {seconds:.3f} s of evaluation per "
                                   f"{period:g} s of footage ({need:.0%} of the replica), and "
                                   f"the watches there already take {held:.0%}, the streams' "
                                   f"appends {appends:.0%} (its seconds {how}); ask less often "
                                   "(every_s) or on fewer streams, or lower the streams' fps, "
                                   "frame size or window")

    def stats(self, live: LiveStream) -> dict[str, object]:
        """What a stream's GET shows of its watches: how far evaluation lags behind the
        stream (footage seconds and wall seconds), chunks coalesced, the replica's load."""
        sw = self.of.get(live.id)
        if sw is None:
            return {"count": 0}
        evaluated = [w.last_ts for w in sw.watches.values() if w.last_ts is not None]
        return {"count": len(sw.watches), "coalesced": sw.coalesced,
                "evaluating": sw.task is not None and not sw.task.done(),
                "lag_s": lag_s(sw),
                "footage_lag_s": None if not evaluated or live.last_ts is None
                else max(0.0, live.last_ts - min(evaluated)),
                "load": sum(share(w, sw) for w in sw.watches.values()),
                "replica_load": self.load(live)}

    async def finished(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the webhooks still sending (their streams' last
        events, :meth:`Watch.finish <apbv.serve.watches.state.Watch.finish>`)."""
        if self.finishing:
            await asyncio.wait(list(self.finishing), timeout=timeout_s)

    def forget(self, live: LiveStream, end: Ending | None) -> None:
        """The stream closed or was lost: its watches end with it; ``end`` (how, None if it
        never was handed to a client) is its ``stream.closed`` event, to every event stream
        that takes it and to each watch's webhook."""
        sw = self.of.pop(live.id, None)
        watches = [] if sw is None else list(sw.watches.values())
        event = None if end is None else closed_event(live.id, end, [w.id for w in watches])
        if end is not None and event is not None:
            self.hub.publish(event)
            log.info("%s ended (%s): %s", live.id, end.reason, end.message)
        for watch in watches:
            if event is None:
                watch.stop()
            else:
                watch.finish(event)
                if watch.sender is not None and not watch.sender.done():
                    self.finishing.add(watch.sender)
                    watch.sender.add_done_callback(self.finishing.discard)
        if sw is None:
            return
        sw.watches.clear()  # a running evaluation ends with its job (never cancelled: the
        sw.pending = None   # replica answers its future), and starts no other
