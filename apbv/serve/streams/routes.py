"""Live streams over HTTP: open, push frames, ask, stats, close (``/v1/streams``).

Everything a client sends is checked here first (fields, limits, images, timestamps, the
memory budget of :mod:`apbv.serve.streams.budget`), and the engine checks again on every rank
alike; the open streams, their queue of operations on the ranks, their capture feeders and
idle clocks are :mod:`apbv.serve.streams.registry`. An ask is a
:class:`~apbv.serve.ranks.ops.Generate`
of a request whose video is the stream (:class:`~apbv.engine.request.StreamRef`), built and
checked as a chat request's is.

A stream pushed by the client opens on the ranks at once when ``width`` / ``height`` were
given, else with its first push (which fixes the frame size). A stream with a ``source`` (a
media file under a ``--media-root``, or a directory of segment files there) is fed by a task
that takes frames from an :class:`apbv.capture.Capture` (a followed file, or the segments in
name order, symbolic links not followed) and appends them. A source is probed before the
stream opens (:meth:`apbv.capture.Source.probe`: a file that is no video is a 400), and why its
capture stopped is the stream's top-level ``error``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from apbv.capture import Source, local_source
from apbv.engine.stream_plan import StreamInfo, StreamSpec
from apbv.openai import chat_body, responses
from apbv.openai.ask import parse_ask
from apbv.openai.bodies import check_url
from apbv.openai.frames import parse_push, resize_to
from apbv.openai.policy import ClientError, resolve_media
from apbv.serve.front.front import Front
from apbv.serve.ranks.ops import DescribeStream, Generate
from apbv.serve.streams.feeder import feed
from apbv.serve.streams.registry import (
    LiveStream,
    StreamOptions,
    StreamRegistry,
    start_capture,
)

__all__ = ["StreamOptions", "Streams"]

OPEN_FIELDS = {"fps", "width", "height", "min_pixels", "max_pixels", "window_s",
               "window_tokens", "keep_vision", "source", "static_threshold"}
PROBE_TIMEOUT_S = 10.0
"""The longest a source's probe at open may take (seconds; it reads a few MiB at most)."""


class Streams:
    """The ``/v1/streams`` routes of one server over its :class:`StreamRegistry`."""

    def __init__(self, front: Front, registry: StreamRegistry):
        self.front, self.registry, self.opt = front, registry, registry.opt

    def _spec(self, body: dict) -> tuple[StreamSpec, bool, tuple[int | None, int | None],
                                         tuple[int, int] | None]:
        fps = chat_body.typed_field(body, "fps", (int, float))
        width = chat_body.typed_field(body, "width", (int,), 1)
        height = chat_body.typed_field(body, "height", (int,), 1)
        min_pixels = chat_body.typed_field(body, "min_pixels", (int,), 1)
        max_pixels = chat_body.typed_field(body, "max_pixels", (int,), 1)
        if (width is None) != (height is None):
            raise ClientError(400, "width and height go together (the native size of the "
                                   "frames you will push), or neither (the first push fixes it)")
        size = None if width is None else \
            self.registry.size_of((min_pixels, max_pixels), (height, width))
        stand_in = self.opt.family.frame_multiple
        try:
            spec = StreamSpec(
                height=size[0] if size else stand_in, width=size[1] if size else stand_in,
                fps=2.0 if fps is None else fps,
                window_s=chat_body.typed_field(body, "window_s", (int, float)),
                window_tokens=chat_body.typed_field(body, "window_tokens", (int,)),
                keep_vision=bool(chat_body.typed_field(body, "keep_vision", (bool,))),
                static_threshold=chat_body.typed_field(body, "static_threshold", (int, float)))
        except ValueError as exc:
            raise ClientError(400, str(exc)) from None
        if spec.window_s is not None and not math.isfinite(spec.window_s * spec.fps):
            raise ClientError(400, f"window_s x fps ({spec.window_s:g} x {spec.fps:g}) "
                                   "overflows: the window holds too many frames to count")
        native = (height, width) if width is not None else None
        return spec, size is not None, (min_pixels, max_pixels), native

    async def open(self, request: Request) -> JSONResponse:
        self.front.authorize(request)
        body = await self.front.read_json(request)
        if not isinstance(body, dict):
            raise ClientError(400, "the body must be a JSON object")
        unknown = sorted(set(body) - OPEN_FIELDS)
        if unknown:
            raise ClientError(400, f"unknown field(s) {unknown}; supported: {sorted(OPEN_FIELDS)}")
        spec, sized, pixels, native = self._spec(body)
        path, source = (None, None) if body.get("source") is None else \
            await self._probe(check_url(body["source"], "source"))
        need = self.registry.need(spec, sized, pixels[1])
        cost = self.registry.price(spec, sized, pixels[1])
        replica = self.registry.place(need, cost, spec, self.registry.pixels(spec, sized,
                                                                             pixels[1]))
        live = LiveStream("stream-" + uuid.uuid4().hex[:16], replica, replica.generation, spec,
                          sized, pixels, need, native=native, predicted=cost)
        self.registry.live[live.id] = live
        try:
            if sized:
                await self.registry.open_on_ranks(live)
            if source is not None:
                live.source = path
                live.capture = start_capture(source, spec, sized, pixels,
                                             self.opt.family.patch_size)
                live.feeder = asyncio.ensure_future(feed(self.registry, live))
        except BaseException:
            self.registry.forget(live)
            raise
        return JSONResponse(self.registry.summary(live), status_code=201)

    async def _probe(self, url: object) -> tuple[str, Source]:
        """The path and source a stream's ``source`` URL names (:func:`resolve_media`),
        probed: a 400 naming the file when it is no video that can be followed, before any
        rank works."""
        path = resolve_media(url, self.front.policy, directory=True)
        source = local_source(path, end_after_s=self.opt.end_after_s, follow_symlinks=False)
        try:
            await asyncio.wait_for(asyncio.to_thread(source.probe), PROBE_TIMEOUT_S)
        except ValueError as exc:
            raise ClientError(400, f"source: {exc}") from None
        except TimeoutError:
            raise ClientError(504, f"source: probing {path!r} took over {PROBE_TIMEOUT_S:g} s"
                              ) from None
        return path, source

    async def push(self, stream_id: str, request: Request) -> JSONResponse:
        self.front.authorize(request)
        live = self.registry.get(stream_id)
        if live.capture is not None:
            raise ClientError(409, f"stream {stream_id!r} is fed by its source; it takes no "
                                   "pushed frames")
        done = self.registry.busy(live)
        try:
            return await self._push(live, await self.front.read_json(request))
        finally:
            done()

    async def _push(self, live: LiveStream, body: object) -> JSONResponse:
        async with live.lock:
            size = (live.spec.height, live.spec.width) if live.sized else None
            push = await asyncio.to_thread(parse_push, body, self.front.limits,
                                           live.native, size, live.last_ts, live.spec.fps)
            if not live.sized:
                self.registry.fix_size(live, self.registry.size_of(live.pixels, push.native))
                live.native = push.native
                push = dataclasses.replace(push, frames=await asyncio.to_thread(
                    resize_to, push.frames, (live.spec.height, live.spec.width)))
            done = await self.registry.append(live, push.frames, push.timestamps)
        return JSONResponse({"id": live.id, "appended": len(push.timestamps),
                             "chunk": done.chunk, "owner": done.owner, "tokens": done.tokens,
                             "evicted": done.evicted, "patches_kept": done.kept,
                             "frames_pushed": live.frames_pushed})

    async def ask(self, stream_id: str, request: Request) -> Response:
        self.front.authorize(request)
        live = self.registry.get(stream_id)
        done = self.registry.busy(live)
        try:
            return await self._ask(live, request, await self.front.read_json(request))
        finally:
            done()

    async def _ask(self, live: LiveStream, request: Request, body: object) -> Response:
        stream_id = live.id
        asked = parse_ask(body, stream_id, self.front.cfg, self.front.limits)
        ask, streamed = asked.request, asked.streamed
        choices, stop_texts = ask.choices, ask.stop_texts
        if not live.opened_on_ranks:
            raise ClientError(400, f"stream {stream_id!r} holds no frames yet: push at least 2")
        if streamed and choices is not None:
            raise ClientError(400, "stream and choices do not go together: a closed-vocabulary "
                                   "answer is one scored choice, not a token stream")
        live.asks += 1
        model, cid = self.front.model_name, responses.completion_id()
        if streamed:
            job = self.registry.admit(live, Generate(ask), sse=True)
            job.future.add_done_callback(
                lambda f: None if f.cancelled() or f.exception() else
                self.front.observe(f.result()[0]))
            return self.front.respond(job, cid, request, model, stop_texts,
                                      extra={"stream": live.id})
        result, wait = await self.registry.run(live, Generate(ask))
        out = responses.answer(model, cid, result, wait, live.replica.index)
        out["apbv"]["stream"] = live.id
        self.front.observe(result)
        return JSONResponse(out)

    async def stats(self, stream_id: str, request: Request) -> JSONResponse:
        self.front.authorize(request)
        live = self.registry.get(stream_id)
        out = self.registry.summary(live)
        out["watches"] = self.registry.listener.stats(live)
        if live.opened_on_ranks:
            out["engine"] = dataclasses.asdict(await self._engine(live))
        return JSONResponse(out)

    async def _engine(self, live: LiveStream) -> StreamInfo:
        """The ranks' figures of ``live`` (a job on them), or their last answer while no append
        ended since (nothing else changes them: a static camera's GET costs the ranks nothing
        either), its held pushes counted as the ranks will count them."""
        done = live.appends_done
        if live.described is None or live.described[0] != done:
            info, _ = await self.registry.run(live, DescribeStream(live.id))
            live.described = (done, info)
        held, info = live.hold, live.described[1]
        return info if held is None else held.counted(info)

    async def close(self, stream_id: str, request: Request) -> JSONResponse:
        self.front.authorize(request)
        live = self.registry.get(stream_id)
        await self.registry.close(live)
        return JSONResponse({"id": live.id, "closed": True})

    def register(self, app: FastAPI) -> None:
        app.post("/v1/streams")(self.open)
        app.post("/v1/streams/{stream_id}/frames")(self.push)
        app.post("/v1/streams/{stream_id}/ask")(self.ask)
        app.get("/v1/streams/{stream_id}")(self.stats)
        app.delete("/v1/streams/{stream_id}")(self.close)
