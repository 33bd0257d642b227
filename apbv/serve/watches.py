"""Standing questions on live streams (``/v1/streams/{id}/watches``) and their events
(``/v1/events``, ``/v1/streams/{id}/events``).

A watch is a closed-vocabulary question asked again over the stream's held KV (a
:class:`~apbv.serve.ops.Generate` of a ``StreamRef`` request in mode ``exact``, through the
replica's queue like any stream operation) after every appended chunk, or once every
``every_s`` seconds of footage; its event rule (:mod:`apbv.serve.watch_rules`) turns the
choices' probabilities into events, published to the event streams
(:class:`apbv.serve.events.EventHub`), the watch's webhook, the server log and Prometheus.

One task per stream evaluates its watches, one evaluation at a time: a chunk that lands while
one runs does not queue another behind it; the next evaluation takes the newest state, and
every chunk folded into it so is counted (``coalesced``). An event's ``footage_ts`` is the
timestamp of the last frame the evaluation saw; ``capture_to_event_s`` runs from the arrival
of the oldest chunk the evaluation was the first to see (so a coalesced chunk's wait counts).

A new watch is refused (429) when the replica's watches would need more than its whole time:
each watch costs its measured evaluation seconds per its stream's footage seconds between
evaluations (:meth:`Watches.load`); the figures are in the message.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import Counter, Histogram

from apbv.engine.request import Request as EngineRequest
from apbv.engine.request import StreamRef
from apbv.serve import chat_body
from apbv.serve.bodies import check_url
from apbv.serve.events import EventHub, Webhook
from apbv.serve.ops import Generate
from apbv.serve.policy import ClientError, remote_url
from apbv.serve.stream_registry import LiveStream
from apbv.serve.watch_rules import Rule, RuleState, observe, top_choice

if TYPE_CHECKING:
    from apbv.serve.streams import Streams

log = logging.getLogger("apbv.serve")

WATCH_FIELDS = {"question", "choices", "every_s", "rule", "choice", "threshold", "hysteresis",
                "hold", "webhook"}
MAX_WATCHES = 8
"""Watches one stream may hold."""
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


@dataclass(eq=False)
class Watch:
    id: str
    stream: str
    request: EngineRequest
    rule: Rule
    every_s: float | None
    webhook: Webhook | None = None
    sender: asyncio.Task | None = None
    state: RuleState = field(default_factory=RuleState)
    evaluations: int = 0
    events: int = 0
    errors: int = 0
    error: str | None = None
    last_ts: float | None = None
    """Footage timestamp of the last frame its last evaluation saw (seconds)."""
    last: dict[str, float] | None = None
    """Its last evaluation's probabilities."""
    eval_s: float | None = None
    """Seconds of its last evaluation (queue wait excluded)."""

    def due(self, footage_ts: float) -> bool:
        """Whether the state whose last frame is at ``footage_ts`` is to be evaluated (never
        twice the same state)."""
        if self.last_ts is None:
            return True
        return footage_ts != self.last_ts if self.every_s is None else \
            footage_ts - self.last_ts >= self.every_s

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "stream": self.stream, "question": self.request.question,
                "choices": list(self.request.choices or ()), "every_s": self.every_s,
                "rule": {"kind": self.rule.kind, "choice": self.rule.choice,
                         "threshold": self.rule.threshold,
                         "hysteresis": self.rule.hysteresis, "hold": self.rule.hold},
                "answer": self.state.answer, "probs": self.last,
                "evaluations": self.evaluations, "events": self.events, "errors": self.errors,
                "error": self.error, "last_timestamp": self.last_ts,
                "webhook": None if self.webhook is None else self.webhook.stats()}


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


class Watches:
    """The watches of one server's streams, their event streams and metrics."""

    def __init__(self, streams: Streams):
        self.streams, self.server = streams, streams.server
        self.registry = streams.registry
        self.registry.on_append, self.registry.on_forget = self.appended, self.forget
        self.of: dict[str, StreamWatches] = {}
        self.hub = EventHub()
        r, label = self.server.metrics.registry, ["model_name"]
        name = self.server.opt.model_name
        self.events_total = Counter("apbv:events", "Standing questions' events", label,
                                    registry=r).labels(name)
        self.latency = Histogram("apbv:capture_to_event_seconds", "Arrival of the chunk to "
                                 "its watch event", label, buckets=LATENCY_BUCKETS,
                                 registry=r).labels(name)
        self.evaluations = Counter("apbv:watch_evaluations", "Evaluations of standing "
                                   "questions", label, registry=r).labels(name)
        self.coalesced = Counter("apbv:watch_coalesced", "Chunks folded into a later "
                                 "evaluation", label, registry=r).labels(name)
        self.dropped = Counter("apbv:events_dropped", "Events a full subscriber or webhook "
                               "queue dropped", label, registry=r).labels(name)

    # --- the routes -------------------------------------------------------------------------

    async def create(self, stream_id: str, request: Request) -> JSONResponse:
        self.server.authorize(request)
        live = self.registry.get(stream_id)
        body = await self.server.read_json(request)
        watch = self._watch(live, body)
        sw = self.of.setdefault(live.id, StreamWatches())
        if len(sw.watches) >= MAX_WATCHES:
            raise ClientError(429, f"stream {live.id!r} holds {len(sw.watches)} watches, the "
                                   f"limit is {MAX_WATCHES}: delete one first")
        self._check_budget(live, watch)
        if watch.webhook is not None:
            watch.sender = asyncio.ensure_future(watch.webhook.run())
        sw.watches[watch.id] = watch
        log.info("watch %s on %s: %r, choices %s, rule %s", watch.id, live.id,
                 watch.request.question[:80], list(watch.request.choices or ()), watch.rule.kind)
        if live.last_ts is not None and sw.pending is None:  # its baseline now (a pending
            self._schedule(live, sw, live.last_ts, time.monotonic())  # round takes it in)
        return JSONResponse(watch.describe(), status_code=201)

    def _watch(self, live: LiveStream, body: object) -> Watch:
        """The watch ``body`` asks for, checked (400 naming the field) before any work."""
        if not isinstance(body, dict):
            raise ClientError(400, "the body must be a JSON object")
        unknown = sorted(set(body) - WATCH_FIELDS)
        if unknown:
            raise ClientError(400, f"unknown field(s) {unknown}; supported: "
                                   f"{sorted(WATCH_FIELDS)}")
        limits = self.server.opt.limits
        question = body.get("question")
        if not isinstance(question, str) or not question.strip():
            raise ClientError(400, "question must be a non-empty string")
        limits.check("question", len(question), limits.max_question_chars,
                     "max-question-chars", "the question's length in characters")
        if body.get("choices") is None:
            raise ClientError(400, "choices is required: a watch answers from a closed "
                                   "vocabulary (e.g. [\"yes\", \"no\"])")
        every_s = chat_body.typed_field(body, "every_s", (int, float))
        if every_s is not None and every_s <= 0:
            raise ClientError(400, f"every_s must be > 0 seconds of footage, got {every_s}")
        try:
            ask = EngineRequest.from_config(
                self.server.cfg, StreamRef(live.id), question, mode="exact",
                max_new_tokens=1, choices=body["choices"])
            assert ask.choices is not None
            rule = Rule(kind=_field(body, "rule", (str,), "change"),
                        choice=chat_body.typed_field(body, "choice", (str,)),
                        threshold=float(_field(body, "threshold", (int, float), 0.5)),
                        hysteresis=float(_field(body, "hysteresis", (int, float), 0.1)),
                        hold=_field(body, "hold", (int,), 1))
            rule.check_choices(ask.choices)
        except ValueError as exc:
            raise ClientError(400, str(exc)) from None
        webhook = None
        if body.get("webhook") is not None:
            url = remote_url(check_url(body["webhook"], "webhook"), self.server.opt.policy)
            if url is None:
                raise ClientError(400, "webhook must be an http(s) URL of a host in "
                                       "--allow-media-domain")
            webhook = Webhook(url)
        return Watch("watch-" + uuid.uuid4().hex[:16], live.id, ask, rule, every_s, webhook)

    async def list_watches(self, stream_id: str, request: Request) -> JSONResponse:
        self.server.authorize(request)
        live = self.registry.get(stream_id)
        sw = self.of.get(live.id, StreamWatches())
        return JSONResponse({"stream": live.id, "object": "list",
                             "data": [w.describe() for w in sw.watches.values()]})

    async def delete(self, stream_id: str, watch_id: str, request: Request) -> JSONResponse:
        self.server.authorize(request)
        live = self.registry.get(stream_id)
        watch = self.of.get(live.id, StreamWatches()).watches.pop(watch_id, None)
        if watch is None:
            raise ClientError(404, f"no watch {watch_id[:64]!r} on stream {live.id!r}")
        _stop(watch)
        return JSONResponse({"id": watch.id, "deleted": True})

    async def events(self, request: Request) -> StreamingResponse:
        """Every stream's events; ``?stream=ID`` and ``?watch=ID`` filter them."""
        self.server.authorize(request)
        stream, watch = request.query_params.get("stream"), request.query_params.get("watch")
        return self._subscribe(stream, watch)

    async def stream_events(self, stream_id: str, request: Request) -> StreamingResponse:
        self.server.authorize(request)
        live = self.registry.get(stream_id)
        return self._subscribe(live.id, request.query_params.get("watch"))

    def _subscribe(self, stream: str | None, watch: str | None) -> StreamingResponse:
        sub = self.hub.subscribe(stream, watch)
        return StreamingResponse(self.hub.stream(sub), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def register(self, app: FastAPI) -> None:
        app.post("/v1/streams/{stream_id}/watches")(self.create)
        app.get("/v1/streams/{stream_id}/watches")(self.list_watches)
        app.delete("/v1/streams/{stream_id}/watches/{watch_id}")(self.delete)
        app.get("/v1/streams/{stream_id}/events")(self.stream_events)
        app.get("/v1/events")(self.events)

    # --- evaluation -------------------------------------------------------------------------

    def appended(self, live: LiveStream, footage_ts: float, arrived: float,
                 chunk_s: float) -> None:
        """A chunk (its last frame at ``footage_ts``, arrived at ``arrived`` monotonic s,
        ``chunk_s`` seconds of footage) is held: evaluate the stream's due watches on it, or
        fold it into the evaluation after the running one."""
        sw = self.of.get(live.id)
        if sw is None or not sw.watches:
            return
        sw.chunk_s = chunk_s
        self._schedule(live, sw, footage_ts, arrived)

    def _schedule(self, live: LiveStream, sw: StreamWatches, footage_ts: float,
                  arrived: float) -> None:
        if sw.pending is not None:  # no evaluation saw the previous chunk: folded in
            sw.coalesced += 1
            self.coalesced.inc()
            arrived = sw.pending[1]
        sw.pending = (footage_ts, arrived)
        if sw.task is None or sw.task.done():
            sw.task = asyncio.ensure_future(self._evaluate(live, sw))

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
        for watch in [w for w in sw.watches.values() if w.due(footage_ts)]:
            if live.closing or self.registry.live.get(live.id) is not live:
                return
            start = time.monotonic()
            try:
                result, wait = await self.registry.run(live, Generate(watch.request))
            except Exception as exc:  # noqa: BLE001  # kept on the watch for GET
                watch.errors += 1
                watch.error = f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"
                continue
            watch.eval_s = time.monotonic() - start - wait
            if sw.watches.get(watch.id) is not watch:
                continue  # deleted meanwhile
            self._judge(watch, result, footage_ts, arrived)

    def _judge(self, watch: Watch, result: Any, footage_ts: float, arrived: float) -> None:
        """Fold an evaluation's ``result`` into ``watch``'s rule; publish an event if any."""
        probs = {c["text"]: float(c["prob"]) for c in result.choices}
        watch.evaluations += 1
        watch.last, watch.last_ts, watch.error = probs, footage_ts, None
        self.evaluations.inc()
        watch.state, change = observe(watch.rule, watch.state, probs)
        if change is None:
            return
        latency = time.monotonic() - arrived
        event = {"object": "watch.event", "watch": watch.id, "stream": watch.stream,
                 "question": watch.request.question, "rule": watch.rule.kind,
                 "choice": watch.rule.choice, "answer": change.answer,
                 "previous": change.previous, "top": top_choice(probs), "probs": probs,
                 "footage_ts": footage_ts, "capture_to_event_s": latency,
                 "ttft_s": result.ttft_s, "evaluation": watch.evaluations,
                 "created": time.time()}
        watch.events += 1
        self.events_total.inc()
        self.latency.observe(latency)
        before = self.hub.dropped
        self.hub.publish(event)
        if watch.webhook is not None:
            before -= watch.webhook.dropped
            watch.webhook.put(event)
            before += watch.webhook.dropped
        self.dropped.inc(self.hub.dropped - before)
        log.info("watch %s on %s: %r -> %r at %.2f s of footage (%.3f s after arrival, TTFT "
                 "%.3f s)", watch.id, watch.stream, change.previous, change.answer, footage_ts,
                 latency, result.ttft_s)

    # --- budget and stats -------------------------------------------------------------------

    def load(self, live: LiveStream) -> float:
        """The share of ``live``'s replica's time its watches take: evaluation seconds per
        footage seconds between evaluations, summed over the watches measured so far."""
        total = 0.0
        for stream_id, sw in self.of.items():
            other = self.registry.live.get(stream_id)
            if other is None or other.replica is not live.replica:
                continue
            total += sum(_share(w, sw) for w in sw.watches.values())
        return total

    def _check_budget(self, live: LiveStream, watch: Watch) -> None:
        sw = self.of[live.id]
        measured = [w.eval_s for w in sw.watches.values() if w.eval_s is not None]
        period = watch.every_s or sw.chunk_s
        if not measured or not period:
            return  # nothing measured yet on this stream: admitted
        need = max(measured) / period
        held = self.load(live)
        if held + need > 1.0:
            raise ClientError(429, f"replica {live.replica.index} cannot sustain this watch: "
                                   f"it needs about {max(measured):.3f} s of evaluation per "
                                   f"{period:g} s of footage ({need:.0%} of the replica), and "
                                   f"the watches there already take {held:.0%}; ask less often "
                                   "(every_s) or on fewer streams")

    def stats(self, live: LiveStream) -> dict[str, Any]:
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
                "replica_load": self.load(live)}

    def forget(self, live: LiveStream) -> None:
        """The stream closed or was lost: its watches end with it."""
        sw = self.of.pop(live.id, None)
        if sw is None:
            return
        for watch in sw.watches.values():
            _stop(watch)
        sw.watches.clear()  # a running evaluation ends with its job (never cancelled: the
        sw.pending = None   # replica answers its future), and starts no other


def lag_s(sw: StreamWatches) -> float:
    """Wall seconds the oldest chunk no evaluation has finished with has waited (0: none)."""
    oldest = sw.running if sw.running is not None else \
        None if sw.pending is None else sw.pending[1]
    return 0.0 if oldest is None else time.monotonic() - oldest


def _share(watch: Watch, sw: StreamWatches) -> float:
    period = watch.every_s or sw.chunk_s
    return 0.0 if watch.eval_s is None or not period else watch.eval_s / period


def _stop(watch: Watch) -> None:
    if watch.sender is not None:
        watch.sender.cancel()


def _field(body: dict, name: str, kinds: tuple[type, ...], default: Any) -> Any:
    """``body[name]`` checked by :func:`apbv.serve.chat_body.typed_field`; ``default`` when absent
    (only then: a 0 given is kept, for the rule to refuse or take)."""
    value = chat_body.typed_field(body, name, kinds)
    return default if value is None else value
