"""Live streams over HTTP: open, push frames, ask, stats, close (``/v1/streams``).

Each open stream lives on one replica (the least loaded ready one with room in its budget);
its ranks hold their part of an :class:`apbv.engine.stream.Stream` under the stream's id. Every
operation that touches the ranks is a :class:`apbv.serve.replicas.GroupOp` in that replica's
queue, so it runs alone on the group, in turn with chat requests. Everything a client sends is
checked here first (fields, limits, images, timestamps, the memory budget of
:mod:`apbv.serve.stream_budget`), and the engine checks again on every rank alike.

A stream pushed by the client opens on the ranks at once when ``width`` / ``height`` were
given, else with its first push (which fixes the frame size). A stream with a ``source`` (a
media file under a ``--media-root``, or a directory of segment files there) is fed by a task
that takes frames from an :class:`apbv.stream.Capture` (a followed file, or the segments in
name order, symbolic links not followed) and appends them. A stream lost with its
replica's ranks (a rank died and the group was rebuilt) answers 410 and frees its budget; a
stream no client touched for ``--stream-idle-s`` is closed, its idle clock counting only
while none of its operations is queued or running (a client waiting on a long ask, or on
the ask queued before it, is using the stream). A source is probed before the stream opens
(:meth:`apbv.stream.Source.probe`: a file that is no video is a 400), and why its capture
stopped is the stream's top-level ``error``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from apbv.engine.request import check_choices, check_stop_texts
from apbv.engine.stream_spec import StreamSpec
from apbv.serve import api, stream_budget
from apbv.serve.admission import Job
from apbv.serve.bodies import check_url
from apbv.serve.frames import parse_push, resize_to
from apbv.serve.policy import ClientError, resolve_media
from apbv.serve.replicas import GroupOp, Replica
from apbv.stream import Capture, Source, local_source, stream_frame_size

OPEN_FIELDS = {"fps", "width", "height", "min_pixels", "max_pixels", "window_s",
               "window_tokens", "keep_vision", "source"}
ASK_FIELDS = {"question", "max_tokens", "choices", "fresh", "stream", "stop"}
PROBE_TIMEOUT_S = 10.0
"""The longest a source's probe at open may take (seconds; it reads a few MiB at most)."""


@dataclass
class StreamOptions:
    budget_bytes: int
    """Per-rank KV bytes all streams of one replica may reserve (--stream-memory-gb)."""
    max_streams: int = 8
    idle_s: float = 600.0
    end_after_s: float | None = 10.0
    """A source ends after this long without news (--stream-end-after-s; None: never)."""
    sizing: stream_budget.KVSizing | None = None


@dataclass(eq=False)
class LiveStream:
    id: str
    replica: Replica
    generation: int
    spec: StreamSpec
    """With the frame size once known (before that, 28x28 stands in)."""
    sized: bool
    pixels: tuple[int | None, int | None]
    reserved: int
    native: tuple[int, int] | None = None
    opened_on_ranks: bool = False
    source: str | None = None
    capture: Any = None
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
    error: str | None = None
    closing: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by a push from its parse to its append, so pushes keep their order."""


class Streams:
    """The open streams of one server, their budget and their routes."""

    def __init__(self, server: Any, options: StreamOptions):
        self.server, self.opt = server, options
        self.live: dict[str, LiveStream] = {}
        self.sweeper: asyncio.Task | None = None

    # --- bookkeeping --------------------------------------------------------------------------
    def held(self, replica: Replica) -> int:
        return sum(s.reserved for s in self.live.values() if s.replica is replica)

    def _get(self, stream_id: str) -> LiveStream:
        live = self.live.get(stream_id)
        if live is None or live.closing:
            raise ClientError(404, f"no open stream {stream_id[:64]!r}")
        if live.generation != live.replica.generation:
            self._forget(live)
            raise ClientError(410, f"stream {stream_id!r} was lost: a rank of replica "
                                   f"{live.replica.index} died and its group was rebuilt; open "
                                   "a new stream")
        live.used = time.monotonic()
        return live

    @staticmethod
    def _busy(live: LiveStream) -> Callable[[], None]:
        """Stop ``live``'s idle clock while a client request on it is handled, until the
        returned function is called (once); the clock starts again from that moment."""
        live.busy += 1

        def done() -> None:
            live.busy -= 1
            live.used = time.monotonic()
        return done

    def _forget(self, live: LiveStream) -> None:
        self.live.pop(live.id, None)
        if live.feeder is not None:
            live.feeder.cancel()
        if live.capture is not None:
            live.capture.close()

    def _admit(self, live: LiveStream, op: str, *args: Any, stream: bool = False,
               **kwargs: Any) -> Job:
        """Queue ``op`` for every rank of the stream's replica, in turn with every other job
        there; ``stream``: the job's token queue gets the answer's ids as they come. A job that
        fails because the replica's ranks were rebuilt meanwhile forgets the stream (its
        place and memory budget), whoever awaits it."""
        replica, generation = live.replica, live.generation

        async def run(group: Any, on_token: Callable[[int], None] | None,
                      cancel: asyncio.Event) -> Any:
            if replica.generation != generation:
                raise ClientError(410, f"stream {live.id!r} was lost with replica "
                                       f"{replica.index}'s ranks; open a new stream")
            return await group.stream(op, live.id, *args, on_token=on_token,
                                      cancel=cancel if op == "ask" else None, **kwargs)

        def forget_if_lost(future: Any) -> None:
            if not future.cancelled() and future.exception() is not None \
                    and replica.generation != generation:
                self._forget(live)

        job = replica.admission.admit(GroupOp(run), {}, sse=stream, predicted_s=0.0,
                                      max_tokens=kwargs.get("max_new_tokens", 0))
        job.replica, job.name = replica, f"{live.id} {op}"

        def ended(_: Any) -> None:  # the idle clock starts again from here
            live.jobs.discard(job)
            live.used = time.monotonic()

        live.jobs.add(job)  # queued or running: the stream is in use
        job.future.add_done_callback(ended)
        job.future.add_done_callback(forget_if_lost)
        return job

    async def _run(self, live: LiveStream, op: str, *args: Any, **kwargs: Any) -> Any:
        """``op`` on every rank of the stream's replica (:meth:`_admit`), its outcome."""
        return await self._admit(live, op, *args, **kwargs).future

    # --- open ---------------------------------------------------------------------------------
    def _spec(self, body: dict) -> tuple[StreamSpec, bool, tuple[int | None, int | None],
                                         tuple[int, int] | None]:
        limits = self.server.opt.limits
        fps = api.typed_field(body, "fps", (int, float))
        width = api.typed_field(body, "width", (int,), 1)
        height = api.typed_field(body, "height", (int,), 1)
        min_pixels = api.typed_field(body, "min_pixels", (int,), 1)
        max_pixels = api.typed_field(body, "max_pixels", (int,), 1)
        if (width is None) != (height is None):
            raise ClientError(400, "width and height go together (the native size of the "
                                   "frames you will push), or neither (the first push fixes it)")
        size = None
        try:
            if width is not None:
                size = stream_frame_size(height, width, min_pixels=min_pixels,
                                         max_pixels=max_pixels)
            spec = StreamSpec(
                height=size[0] if size else 28, width=size[1] if size else 28,
                fps=2.0 if fps is None else fps,
                window_s=api.typed_field(body, "window_s", (int, float)),
                window_tokens=api.typed_field(body, "window_tokens", (int,)),
                keep_vision=bool(api.typed_field(body, "keep_vision", (bool,))))
        except ValueError as exc:
            raise ClientError(400, str(exc)) from None
        if spec.window_s is not None and not math.isfinite(spec.window_s * spec.fps):
            raise ClientError(400, f"window_s x fps ({spec.window_s:g} x {spec.fps:g}) "
                                   "overflows: the window holds too many frames to count")
        if size is not None:
            limits.check("pixels", size[0] * size[1], limits.max_pixels_per_frame,
                         "max-pixels-per-frame", "pixels per resized frame")
        native = (height, width) if width is not None else None
        return spec, size is not None, (min_pixels, max_pixels), native

    def _need(self, spec: StreamSpec, sized: bool, max_pixels: int | None) -> int:
        limits = self.server.opt.limits
        if sized:
            pixels = spec.height * spec.width
        else:
            pixels = min(max_pixels or limits.max_pixels_per_frame, limits.max_pixels_per_frame)
        sizing = self.opt.sizing
        assert sizing is not None
        return sizing.need(max(1, pixels // (28 * 28)), spec.fps, spec.window_s,
                           spec.window_tokens)

    def _place(self, need: int) -> Replica:
        if len(self.live) >= self.opt.max_streams:
            raise ClientError(429, f"{len(self.live)} streams are open, the limit is "
                                   f"{self.opt.max_streams} (--max-streams): close one first")
        usable = [r for r in self.server.replicas if r.status == "ready"]
        if not usable:
            raise ClientError(503, "no engine group is ready; retry shortly")
        replica = min(usable, key=lambda r: (self.held(r), r.load, r.index))
        stream_budget.check_fits(need, self.held(replica), self.opt.budget_bytes,
                                 sum(s.replica is replica for s in self.live.values()))
        return replica

    async def open(self, request: Request) -> JSONResponse:
        self.server._authorize(request)
        body = await self.server._read_json(request)
        if not isinstance(body, dict):
            raise ClientError(400, "the body must be a JSON object")
        unknown = sorted(set(body) - OPEN_FIELDS)
        if unknown:
            raise ClientError(400, f"unknown field(s) {unknown}; supported: {sorted(OPEN_FIELDS)}")
        spec, sized, pixels, native = self._spec(body)
        path, source = (None, None) if body.get("source") is None else \
            await self._probe(check_url(body["source"], "source"))
        need = self._need(spec, sized, pixels[1])
        replica = self._place(need)
        live = LiveStream("stream-" + uuid.uuid4().hex[:16], replica, replica.generation, spec,
                          sized, pixels, need, native=native)
        self.live[live.id] = live
        try:
            if sized:
                await self._run(live, "open", spec)
                live.opened_on_ranks = True
            if source is not None:
                live.source = path
                live.capture = _start_capture(source, spec, sized, pixels)
                live.feeder = asyncio.ensure_future(self._feed(live))
        except BaseException:
            self._forget(live)
            raise
        return JSONResponse(self._summary(live), status_code=201)

    async def _probe(self, url: object) -> tuple[str, Source]:
        """The path and source a stream's ``source`` URL names (:func:`resolve_media`),
        probed: a 400 naming the file when it is no video that can be followed, before any
        rank works."""
        path = resolve_media(url, self.server.opt.policy, directory=True)
        source = local_source(path, end_after_s=self.opt.end_after_s, follow_symlinks=False)
        try:
            await asyncio.wait_for(asyncio.to_thread(source.probe), PROBE_TIMEOUT_S)
        except ValueError as exc:
            raise ClientError(400, f"source: {exc}") from None
        except asyncio.TimeoutError:
            raise ClientError(504, f"source: probing {path!r} took over {PROBE_TIMEOUT_S:g} s"
                              ) from None
        return path, source

    # --- frames -------------------------------------------------------------------------------
    async def push(self, stream_id: str, request: Request) -> JSONResponse:
        self.server._authorize(request)
        live = self._get(stream_id)
        if live.capture is not None:
            raise ClientError(409, f"stream {stream_id!r} is fed by its source; it takes no "
                                   "pushed frames")
        done = self._busy(live)
        try:
            return await self._push(live, await self.server._read_json(request))
        finally:
            done()

    async def _push(self, live: LiveStream, body: object) -> JSONResponse:
        async with live.lock:
            size = (live.spec.height, live.spec.width) if live.sized else None
            push = await asyncio.to_thread(parse_push, body, self.server.opt.limits,
                                           live.native, size, live.last_ts, live.spec.fps)
            if not live.sized:
                self._fix_size(live, self._size_of(live, push.native))
                live.native = push.native
                push = dataclasses.replace(push, frames=await asyncio.to_thread(
                    resize_to, push.frames, (live.spec.height, live.spec.width)))
            out = await self._append(live, push.frames, push.timestamps)
        return JSONResponse({"id": live.id, **out, "frames_pushed": live.frames_pushed})

    def _size_of(self, live: LiveStream, native: tuple[int, int]) -> tuple[int, int]:
        """The stream's frame size for frames of the ``native`` (H, W) size."""
        limits = self.server.opt.limits
        try:
            size = stream_frame_size(native[0], native[1], min_pixels=live.pixels[0],
                               max_pixels=live.pixels[1])
        except ValueError as exc:
            raise ClientError(400, str(exc)) from None
        limits.check("pixels", size[0] * size[1], limits.max_pixels_per_frame,
                     "max-pixels-per-frame", "pixels per resized frame")
        return size

    def _fix_size(self, live: LiveStream, size: tuple[int, int]) -> None:
        """The first frames fix the frame size: the spec and the reservation with it."""
        spec = dataclasses.replace(live.spec, height=size[0], width=size[1])
        need = self._need(spec, True, None)
        if need > live.reserved:
            replica = live.replica
            stream_budget.check_fits(need - live.reserved, self.held(replica),
                                     self.opt.budget_bytes,
                                     sum(s.replica is replica for s in self.live.values()))
        live.spec, live.sized, live.reserved = spec, True, need

    async def _append(self, live: LiveStream, frames: Any, stamps: list[float]) -> dict:
        if not live.opened_on_ranks:
            await self._run(live, "open", live.spec)
            live.opened_on_ranks = True
        result, _ = await self._run(live, "append", frames, stamps)
        live.frames_pushed += len(stamps)
        live.pushes += 1
        live.last_ts = stamps[-1]
        live.last_push_wall = time.monotonic()
        return {"appended": len(stamps), "chunk": result["chunk"], "owner": result["owner"],
                "tokens": result["tokens"], "evicted": result["evicted"]}

    async def _feed(self, live: LiveStream) -> None:
        """Move frames from the stream's capture to its ranks until the capture ends."""
        import torch

        cap, limit = live.capture, self.server.opt.limits.max_frames_per_push
        try:
            while True:
                frames = await asyncio.to_thread(cap.take, limit, timeout=0.5)
                if frames:
                    if not live.sized:
                        self._fix_size(live, tuple(frames[0].image.shape[1:]))
                    batch = torch.stack([f.image for f in frames])
                    while True:
                        try:
                            await self._append(live, batch, [f.timestamp for f in frames])
                            break
                        except ClientError as exc:
                            if exc.status != 429:  # the queue is full: try again shortly
                                raise
                            await asyncio.sleep(0.25)
                elif cap.stats()["ended"]:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # kept for GET; the stream stays open for asks
            live.error = f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"

    # --- ask, stats, close ----------------------------------------------------------------------
    async def ask(self, stream_id: str, request: Request) -> Response:
        self.server._authorize(request)
        live = self._get(stream_id)
        done = self._busy(live)
        try:
            return await self._ask(live, request, await self.server._read_json(request))
        finally:
            done()

    async def _ask(self, live: LiveStream, request: Request, body: object) -> Response:
        stream_id = live.id
        limits = self.server.opt.limits
        if not isinstance(body, dict) or set(body) - ASK_FIELDS:
            raise ClientError(400, f"the body must be a JSON object with fields among "
                                   f"{sorted(ASK_FIELDS)}")
        question = body.get("question")
        if not isinstance(question, str) or not question.strip():
            raise ClientError(400, "question must be a non-empty string")
        limits.check("question", len(question), limits.max_question_chars, "max-question-chars",
                     "the question's length in characters")
        max_tokens = api.typed_field(body, "max_tokens", (int,), 1) or \
            self.server.cfg.generate.max_new_tokens
        limits.check("max_tokens", max_tokens, limits.max_tokens, "max-tokens", "max_tokens")
        choices = body.get("choices")
        fresh = bool(api.typed_field(body, "fresh", (bool,)))
        streamed = bool(api.typed_field(body, "stream", (bool,)))
        try:
            choices = None if choices is None else list(check_choices(choices))
            stop_texts = check_stop_texts(() if body.get("stop") is None else body["stop"],
                                          choices)
        except ValueError as exc:
            raise ClientError(400, str(exc)) from None
        if not live.opened_on_ranks:
            raise ClientError(400, f"stream {stream_id!r} holds no frames yet: push at least 2")
        if streamed and choices is not None:
            raise ClientError(400, "stream and choices do not go together: a closed-vocabulary "
                                   "answer is one scored choice, not a token stream")
        live.asks += 1
        model, cid = self.server.opt.model_name, api.completion_id()
        if streamed:
            job = self._admit(live, "ask", question, max_new_tokens=max_tokens, fresh=fresh,
                              stop_texts=stop_texts, stream=True)
            job.future.add_done_callback(
                lambda f: None if f.cancelled() or f.exception() else
                self.server._observe(f.result()[0]))
            return self.server.sse(job, cid, request, model, stop_texts, stream=live.id)
        result, wait = await self._run(live, "ask", question, max_new_tokens=max_tokens,
                                       choices=choices, fresh=fresh, stop_texts=stop_texts)
        out = api.answer(model, cid, result, wait, live.replica.index)
        out["apbv"]["stream"] = live.id
        self.server._observe(result)
        return JSONResponse(out)

    async def stats(self, stream_id: str, request: Request) -> JSONResponse:
        self.server._authorize(request)
        live = self._get(stream_id)
        out = self._summary(live)
        if live.opened_on_ranks:
            out["engine"], _ = await self._run(live, "describe")
        return JSONResponse(out)

    async def close(self, stream_id: str, request: Request) -> JSONResponse:
        self.server._authorize(request)
        live = self._get(stream_id)
        await self._close(live)
        return JSONResponse({"id": live.id, "closed": True})

    async def _close(self, live: LiveStream) -> None:
        """Close on every rank, then free the budget (a full queue leaves it open)."""
        if live.feeder is not None:
            live.feeder.cancel()
        live.closing = True  # no new operation from here on
        try:
            if live.opened_on_ranks and live.generation == live.replica.generation:
                await self._run(live, "close")
        except ClientError as exc:
            if exc.status == 429:
                live.closing = False
                raise
        self._forget(live)

    def _summary(self, live: LiveStream) -> dict[str, Any]:
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

    def _idle(self, live: LiveStream) -> bool:
        """No request on ``live`` handled and no operation of it queued or running, and none
        for ``idle_s`` seconds."""
        dropped = {job for job in live.jobs if not job.future.done()
                   and not _queued_or_running(job)}
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
            for live in [s for s in self.live.values() if self._idle(s)]:
                if not self._idle(live) or self.live.get(live.id) is not live:
                    continue  # used, or closed, while an earlier one was being closed
                try:
                    await self._close(live)
                except ClientError:
                    pass  # lost with its ranks, or the queue is full: forgotten anyway

    def register(self, app: FastAPI) -> None:
        app.post("/v1/streams")(self.open)
        app.post("/v1/streams/{stream_id}/frames")(self.push)
        app.post("/v1/streams/{stream_id}/ask")(self.ask)
        app.get("/v1/streams/{stream_id}")(self.stats)
        app.delete("/v1/streams/{stream_id}")(self.close)



def _queued_or_running(job: Job) -> bool:
    """Whether ``job`` waits in its replica's queue or runs there (False once it ended, or
    was taken out of the queue unrun)."""
    admission = job.replica.admission
    return admission.running is job or any(j is job for _, j in admission.heap)


def _start_capture(source: Source, spec: StreamSpec, sized: bool,
                   pixels: tuple[int | None, int | None]) -> Capture:
    size = (spec.height, spec.width) if sized else None
    return Capture(source, fps=spec.fps, size=size,
                           min_pixels=None if sized else pixels[0],
                           max_pixels=None if sized else pixels[1])
