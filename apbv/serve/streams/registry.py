"""The open live streams of one server: where each lives, its memory budget, its queue of
operations on the ranks, its capture feeder and its idle clock (the HTTP routes are
:mod:`apbv.serve.streams.routes`).

Each open stream lives on one replica (the ready one with room in its budget whose streams'
appends and watches take the least of its time, :func:`apbv.serve.ranks.placement.place_stream`);
its ranks' engines hold their part of it under the stream's id.
Every operation that touches the ranks (:mod:`apbv.serve.ranks.ops`) is a job in that replica's
queue (:meth:`StreamRegistry.admit`), so it runs alone on the group, in turn with chat
requests. A stream ends when its replica's ranks are found lost (the group is rebuilt), or,
no client having touched it for ``--stream-idle-s``, is closed (:meth:`StreamRegistry.sweep`;
its idle clock counts only while none of its operations is queued or running); how it ended is
told and remembered (:mod:`apbv.serve.streams.end`). A stream with a ``source`` is fed by a
task that takes frames from its :class:`apbv.capture.Capture` (:mod:`apbv.serve.streams.feeder`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch

from apbv.capture import Capture, Source
from apbv.cost.stream import StreamCost
from apbv.engine.stream_plan import Appended, StreamInfo, StreamSpec
from apbv.openai.policy import ClientError, Limits
from apbv.serve.ranks.ops import CloseStream, Op, OpenStream
from apbv.serve.ranks.placement import ReplicaLoad, place_stream
from apbv.serve.scheduler.admission import Job
from apbv.serve.scheduler.replicas import Replica
from apbv.serve.streams import budget as stream_budget
from apbv.serve.streams import pricing as stream_time
from apbv.serve.streams.end import EndedStreams, ending, lost_detail
from apbv.serve.streams.hold import PushHold
from apbv.serve.streams.hold import append as held_append
from apbv.serve.streams.listener import NoListener, StreamListener
from apbv.serve.streams.options import StreamOptions

__all__ = ["LiveStream", "StreamOptions", "StreamRegistry", "start_capture"]

T = TypeVar("T")


@dataclass(eq=False)
class LiveStream:
    id: str
    replica: Replica
    generation: int
    spec: StreamSpec
    """With the frame size once known (before that, one frame multiple square stands in)."""
    sized: bool
    pixels: tuple[int | None, int | None]
    reserved: int
    native: tuple[int, int] | None = None
    opened_on_ranks: bool = False
    source: str | None = None
    capture: Capture | None = None
    feeder: asyncio.Task | None = None
    opened: float = field(default_factory=time.monotonic)
    used: float = field(default_factory=time.monotonic)
    """When a client last touched the stream or one of its operations ended (monotonic s)."""
    busy: int = 0
    """Client requests on the stream now being handled."""
    jobs: set[Job] = field(default_factory=set)
    """Its operations admitted to the replica's queue and not yet ended: with ``busy``, the
    idle clock runs only while there are none."""
    frames_pushed: int = 0
    pushes: int = 0
    asks: int = 0
    last_ts: float | None = None
    last_push_wall: float | None = None
    append_s: tuple[float, float] | None = None
    """Its last append's (seconds queued, seconds on the ranks)."""
    append_load: float = 0.0
    """Its recent appends' seconds on the ranks per second of footage (``recent.load``)."""
    recent: stream_time.RecentAppends = field(default_factory=stream_time.RecentAppends)
    predicted: StreamCost | None = None
    """The cost model's figures for it (:mod:`apbv.serve.streams.pricing`; None: not priced)."""
    error: str | None = None
    closing: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by a push from its parse to its append, so pushes keep their order."""
    hold: PushHold | None = None
    """Its pushes' judge and backlog (:mod:`apbv.serve.streams.hold`; None: no pruning)."""
    appends_done: int = 0
    """Its appends that ended on the ranks (queued and run, or refused there)."""
    described: tuple[int, StreamInfo] | None = None
    """The ranks' last figures of it, with :attr:`appends_done` when they were asked."""


class StreamRegistry:
    """The open streams of one server (``live``, by id) and their budget, over ``replicas``
    (the server's list) under the server's ``limits``; ``listener`` makes, from the registry,
    what is told of its appends and ends (:class:`~apbv.serve.streams.listener.StreamListener`:
    the standing questions; None: nothing listens)."""

    def __init__(self, replicas: list[Replica], limits: Limits, options: StreamOptions,
                 listener: Callable[[StreamRegistry], StreamListener[LiveStream]] | None = None):
        self.replicas, self.limits, self.opt = replicas, limits, options
        self.live: dict[str, LiveStream] = {}
        self.ended = EndedStreams()
        for replica in replicas:  # its ranks lost: its streams end at once
            replica.on_lost.append(self.lost)
        self.listener: StreamListener[LiveStream] = \
            NoListener() if listener is None else listener(self)
        self.pushes_held = 0
        """Pushes held on the server (:mod:`apbv.serve.streams.hold`) since it started."""

    def held(self, replica: Replica) -> int:
        return sum(s.reserved for s in self.live.values() if s.replica is replica)

    def get(self, stream_id: str) -> LiveStream:
        live = self.live.get(stream_id)
        if live is None or live.closing:
            raise self.ended.refusal(stream_id) or \
                ClientError(404, f"no open stream {stream_id[:64]!r}")
        if live.generation != live.replica.generation:
            self.forget(live, "lost", lost_detail(live.replica))
            raise self.ended.refusal(stream_id) or ClientError(410, "lost")
        live.used = time.monotonic()
        return live

    @staticmethod
    def busy(live: LiveStream) -> Callable[[], None]:
        """Stop ``live``'s idle clock while a client request on it is handled, until the
        returned function is called (once); the clock starts again from that moment."""
        live.busy += 1

        def done() -> None:
            live.busy -= 1
            live.used = time.monotonic()
        return done

    def forget(self, live: LiveStream, reason: str | None = None, detail: str = "") -> None:
        """Drop ``live`` (its place, budget, feeder); ``reason`` (:data:`stream_end.REASONS
        <apbv.serve.streams.end.REASONS>`): how it ended, told and remembered (None: it was
        never handed to a client)."""
        known = self.live.get(live.id) is live
        if known:
            del self.live[live.id]
        end = ending(live.id, reason, detail) if known and reason is not None else None
        if end is not None:
            self.ended.add(live.id, end)
        self.listener.forget(live, end)
        if live.feeder is not None:
            live.feeder.cancel()
        if live.capture is not None:
            live.capture.close()

    def admit(self, live: LiveStream, op: Op[object], *, sse: bool = False,
              evaluates: float | None = None) -> Job:
        """Queue ``op`` for every rank of the stream's replica, in turn with every other job
        there; ``sse``: the job's token queue gets the answer's ids as they come; ``evaluates``:
        a standing question's evaluation (:attr:`apbv.serve.scheduler.admission.Job.evaluates`). A
        job that fails because the replica's ranks were rebuilt meanwhile forgets the stream (its
        place and memory budget), whoever awaits it."""
        replica, generation = live.replica, live.generation

        def forget_if_lost(future: asyncio.Future) -> None:
            if not future.cancelled() and future.exception() is not None \
                    and replica.generation != generation:
                self.forget(live, "lost", lost_detail(replica))

        job = replica.admission.admit(None, {}, op=op, sse=sse, predicted_s=0.0,
                                      max_tokens=op.max_tokens, stream_id=live.id,
                                      generation=generation, evaluates=evaluates)
        job.replica, job.name = replica, f"{live.id} {op.what}"

        def ended(_: asyncio.Future) -> None:  # the idle clock starts again from here
            live.jobs.discard(job)
            live.appends_done += op.what == "append"
            live.used = time.monotonic()

        live.jobs.add(job)  # queued or running: the stream is in use
        job.future.add_done_callback(ended)
        job.future.add_done_callback(forget_if_lost)
        return job

    async def run(self, live: LiveStream, op: Op[T], evaluates: float | None = None
                  ) -> tuple[T, float]:
        """``op`` on every rank of the stream's replica (:meth:`admit`): (its outcome, the
        seconds it waited)."""
        done = await self.admit(live, op, evaluates=evaluates).future
        return cast(tuple[T, float], done)  # the replica answers the job's op with a T

    def need(self, spec: StreamSpec, sized: bool, max_pixels: int | None) -> int:
        sizing = self.opt.sizing
        assert sizing is not None
        return sizing.need(sizing.unit_tokens(self.pixels(spec, sized, max_pixels)), spec.fps,
                           spec.window_s, spec.window_tokens, spec.keep_vision)

    def pixels(self, spec: StreamSpec, sized: bool, max_pixels: int | None) -> int:
        """Pixels per frame a stream is sized by: its frames', or before they are known the
        most its ``max_pixels`` and --max-pixels-per-frame allow."""
        most = self.limits.max_pixels_per_frame
        return spec.height * spec.width if sized else min(max_pixels or most, most)

    def price(self, spec: StreamSpec, sized: bool, max_pixels: int | None, question: str = "",
              choices: tuple[str, ...] = (), keep_rate: float = 1.0) -> StreamCost | None:
        """:meth:`~apbv.serve.streams.pricing.StreamPricing.cost` of a stream keeping
        ``keep_rate`` of its temporal patches (and an ask on it); None without a cost model."""
        pricing, sizing = self.opt.pricing, self.opt.sizing
        if pricing is None or sizing is None:
            return None
        return pricing.cost(sizing, spec, self.pixels(spec, sized, max_pixels), question,
                            choices, keep_rate)

    def place(self, need: int, cost: StreamCost | None = None, spec: StreamSpec | None = None,
              pixels: int = 0) -> Replica:
        """The replica a new stream reserving ``need`` bytes per rank goes to; ClientError 429
        when it is full, or the stream's predicted ``cost`` (of ``spec``, ``pixels`` per frame)
        would take it past its whole time (:func:`apbv.serve.streams.pricing.check_stream`)."""
        if len(self.live) >= self.opt.max_streams:
            raise ClientError(429, f"{len(self.live)} streams are open, the limit is "
                                   f"{self.opt.max_streams} (--max-streams): close one first")
        usable = [r for r in self.replicas if r.status == "ready"]
        if not usable:
            raise ClientError(503, "no engine group is ready; retry shortly")
        index = place_stream([ReplicaLoad(r.index, self.time_share(r), self.held(r), r.load)
                              for r in usable], need, self.opt.budget_bytes)
        if index is None:  # none holds it: the 507 names the emptiest one's figures
            replica = min(usable, key=lambda r: (self.held(r), r.index))
            stream_budget.check_fits(need, self.held(replica), self.opt.budget_bytes,
                                     sum(s.replica is replica for s in self.live.values()))
        best = next(r for r in usable if r.index == index)
        if cost is not None and spec is not None:
            stream_time.check_stream(best.index, self.time_share(best), cost,
                                     self.appends(best)[1], spec, pixels)
        return best

    def appends(self, replica: Replica) -> tuple[float, float]:
        """(seconds ``replica``'s open streams' appends take on its ranks per second of
        footage, the scale on its predictions): :func:`apbv.serve.streams.pricing.combined_load`."""
        return stream_time.combined_load(
            (None if s.append_s is None and s.predicted else s.append_load,
             None if s.predicted is None or s.recent.mostly_pruned else s.predicted.append_load)
            for s in self.live.values() if s.replica is replica)

    def time_share(self, replica: Replica) -> float:
        """Seconds ``replica``'s open streams' appends and watches take on its ranks per second
        of footage (:meth:`appends` and the listener's share, the watches')."""
        return self.appends(replica)[0] + self.listener.replica_load(replica)

    def size_of(self, pixels: tuple[int | None, int | None],
                native: tuple[int, int]) -> tuple[int, int]:
        """A stream's frame size for frames of the ``native`` (H, W) size and its ``pixels``
        (min, max) bounds, by the served family's rule (:meth:`StreamOptions.frame_size`);
        ClientError 400 for values the rule refuses or a size past --max-pixels-per-frame."""
        limits = self.limits
        try:
            size = self.opt.frame_size(native[0], native[1], *pixels)
        except ValueError as exc:
            raise ClientError(400, str(exc)) from None
        limits.check("pixels", size[0] * size[1], limits.max_pixels_per_frame,
                     "max-pixels-per-frame", "pixels per resized frame")
        return size

    def fix_size(self, live: LiveStream, size: tuple[int, int]) -> None:
        """The first frames fix the frame size: the spec and the reservation with it."""
        spec = dataclasses.replace(live.spec, height=size[0], width=size[1])
        need = self.need(spec, True, None)
        if need > live.reserved:
            replica = live.replica
            stream_budget.check_fits(need - live.reserved, self.held(replica),
                                     self.opt.budget_bytes,
                                     sum(s.replica is replica for s in self.live.values()))
        live.spec, live.sized, live.reserved = spec, True, need
        live.predicted = self.price(spec, True, None)

    async def append(self, live: LiveStream, frames: torch.Tensor,
                     stamps: list[float]) -> Appended:
        """Append ``frames`` (at ``stamps``) to ``live`` on its ranks, or hold them here
        (:mod:`apbv.serve.streams.hold`): what the engine did (or, held, will do)."""
        arrived = time.monotonic()
        if not live.opened_on_ranks:
            await self.open_on_ranks(live)
        queued = time.monotonic()
        result, wait = await held_append(live.hold, lambda op: self.admit(live, op), live.id,
                                         frames, stamps)
        self.pushes_held += wait is None  # held: no job, no time on the ranks
        live.append_s = (0.0, 0.0) if wait is None else (wait, time.monotonic() - queued - wait)
        live.append_load = live.recent.add(result, live.append_s[1], len(stamps) / live.spec.fps)
        if live.predicted is not None and result.patches:  # priced at its keep rate
            live.predicted = self.price(live.spec, True, None, keep_rate=live.recent.priced)
        live.frames_pushed += len(stamps)
        live.pushes += 1
        live.last_ts = stamps[-1]
        live.last_push_wall = time.monotonic()
        self.listener.appended(live, stamps[-1], arrived, len(stamps) / live.spec.fps)
        return result

    async def open_on_ranks(self, live: LiveStream) -> None:
        """Open ``live`` on its replica's ranks (its spec fixed): with temporal pruning, its
        pushes are judged here first, as the ranks opened it (:mod:`apbv.serve.streams.hold`)."""
        info, _ = await self.run(live, OpenStream(live.id, live.spec))
        live.opened_on_ranks = True
        live.hold = PushHold.of(info, self.limits.max_frames_per_push)

    def lost(self, replica: Replica) -> None:
        """``replica``'s ranks were lost: its streams end (``lost``)."""
        for live in [s for s in self.live.values() if s.replica is replica
                     and s.generation != replica.generation]:
            self.forget(live, "lost", lost_detail(replica))

    def shutdown(self) -> None:
        """The server stops: every stream ends (``server shutdown``)."""
        for live in list(self.live.values()):
            self.forget(live, "server shutdown")

    async def close(self, live: LiveStream, reason: str = "closed") -> None:
        """Close on every rank, then free the budget (a full queue leaves it open);
        ``reason``: ``closed`` (its client) or ``idle``."""
        if live.feeder is not None:
            live.feeder.cancel()
        live.closing = True  # no new operation from here on
        try:
            if live.opened_on_ranks and live.generation == live.replica.generation:
                await self.run(live, CloseStream(live.id))
        except ClientError as exc:
            if exc.status == 429:
                live.closing = False
                raise
        self.forget(live, reason, f"{self.opt.idle_s:g} s" if reason == "idle" else "")

    def summary(self, live: LiveStream) -> dict[str, Any]:
        now = time.monotonic()
        out = {
            "id": live.id, "replica": live.replica.index,
            "spec": {**dataclasses.asdict(live.spec),
                     "height": live.spec.height if live.sized else None,
                     "width": live.spec.width if live.sized else None},
            "native_size": None if live.native is None else
            {"height": live.native[0], "width": live.native[1]},
            "source": live.source, "open_s": now - live.opened,
            "frames_pushed": live.frames_pushed, "pushes": live.pushes, "asks": live.asks,
            "pushes_held": 0 if live.hold is None else live.hold.pushes_held,
            "last_timestamp": live.last_ts,
            "since_last_frame_s": None if live.last_push_wall is None
            else now - live.last_push_wall,
            "frames_dropped": 0, "ingest_lag_s": 0.0, "error": live.error,
            **stream_budget.describe(live.reserved, self.opt.budget_bytes),
        }
        if live.capture is not None:
            capture = live.capture.stats()
            out.update(frames_dropped=capture["frames_dropped"],
                       ingest_lag_s=capture["ingest_lag_s"], capture=capture)
            if out["error"] is None and capture["error"] is not None:
                out["error"] = f"the source failed: {capture['error']}"  # it takes no more
        return out

    def idle(self, live: LiveStream) -> bool:
        """No request on ``live`` handled and no operation of it queued or running, and none
        for ``idle_s`` seconds."""
        dropped = {job for job in live.jobs if not job.future.done()
                   and not queued_or_running(job)}
        if dropped:  # taken out of the queue unrun (its client went away): ended now
            live.jobs -= dropped
            live.used = time.monotonic()
        return live.busy == 0 and not live.jobs and \
            time.monotonic() - live.used > self.opt.idle_s

    async def sweep(self) -> None:
        """Close the streams idle for ``idle_s`` seconds (forever): untouched by any client,
        and none of their operations queued or running meanwhile."""
        while True:
            await asyncio.sleep(min(5.0, self.opt.idle_s / 2))
            for live in [s for s in self.live.values() if self.idle(s)]:
                if not self.idle(live) or self.live.get(live.id) is not live:
                    continue  # used, or closed, while an earlier one was being closed
                try:
                    await self.close(live, "idle")
                except ClientError:
                    pass  # lost with its ranks, or the queue is full: forgotten anyway


def queued_or_running(job: Job) -> bool:
    """Whether ``job`` waits in its replica's queue or runs there (False once it ended, or
    was taken out of the queue unrun)."""
    admission = job.replica.admission
    return admission.running is job or any(j is job for _, j in admission.heap)


def start_capture(source: Source, spec: StreamSpec, sized: bool,
                   pixels: tuple[int | None, int | None], image_patch_size: int) -> Capture:
    size = (spec.height, spec.width) if sized else None
    return Capture(source, fps=spec.fps, size=size,
                           min_pixels=None if sized else pixels[0],
                           max_pixels=None if sized else pixels[1],
                           image_patch_size=image_patch_size)
