"""The HTTP front end: FastAPI routes, API key, the bounded admission queue.

The metrics (:mod:`apbv.serve.front.metrics`) are served at ``/metrics``, open (as vLLM's and
SGLang's: keep it behind the network's firewall) unless ``protect_metrics``; a request body is
read as :mod:`apbv.openai.chat` parses it, the answer shaped by :mod:`apbv.openai.responses`, or
streamed by :mod:`apbv.serve.front.sse`.

One :class:`Server` owns the replicas (:mod:`apbv.serve.scheduler.replicas`: R rank groups, each
with a bounded queue and one worker): requests are validated here (media policy, limits; remote
media downloaded on the event loop, the files probed on the server's own request threads, which no
download occupies) before anything reaches a rank, routed to a replica (the one whose vision cache
holds the video, else the least loaded), wait in its queue (FIFO; earliest deadline first for
those with ``deadline_ms``), and its worker hands them to its group one at a time. A lost rank
fails that replica's in-flight request (503 naming the rank), its group is rebuilt, and its
queue is then served; nothing is answered twice.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from apbv import package_version
from apbv.model.families import family_of
from apbv.openai import chat as api
from apbv.openai import responses
from apbv.openai.bodies import decode_json
from apbv.openai.chat_body import ChatBody
from apbv.openai.download import Held, discard, fetch_media
from apbv.openai.policy import ClientError, Limits, MediaPolicy, error_body
from apbv.openai.request_id import RequestIdMiddleware
from apbv.serve import log_format, page
from apbv.serve.front.front import Front, Processor
from apbv.serve.front.metrics import Metrics, StreamLoad
from apbv.serve.http_guard import HostRule, HttpGuard
from apbv.serve.model_card import checkpoint_positions, max_model_len, model_card
from apbv.serve.scheduler.admission import Admission
from apbv.serve.scheduler.replicas import Replica, overall_status, pick
from apbv.serve.streams.registry import StreamRegistry
from apbv.serve.streams.routes import StreamOptions, Streams
from apbv.serve.watches.routes import Watches

if TYPE_CHECKING:
    from apbv.config import RuntimeConfig
    from apbv.serve.ranks.group import RankGroup
P = ParamSpec("P")
T = TypeVar("T")
log = logging.getLogger("apbv.serve")
IGNORED_SHOWN = 32
"""Ignored fields named in the log and the header at most (the response lists them all)."""
SHUTDOWN_WEBHOOKS_S = 2.0
"""Seconds the stopping server waits for webhooks to send their streams' last events."""


@dataclass
class ServerOptions:
    model_name: str
    limits: Limits = field(default_factory=Limits)
    policy: MediaPolicy = field(default_factory=MediaPolicy)
    api_key: str | None = None
    max_queue: int = 16
    streams: StreamOptions | None = None
    """Live streams (``/v1/streams``); None: those routes are not served."""
    hosts: HostRule | None = None
    """The Host headers requests may carry (--host, --port, --allow-host); None: any."""
    read_timeout_s: float | None = None
    """Seconds a request body may take to arrive after its head (--read-timeout-s)."""
    protect_metrics: bool = False
    """``/metrics`` asks for the API key too (--protect-metrics); else it is open."""
    webhook_hosts: tuple[str, ...] = ()
    """The hosts watches may post events to (--allow-webhook-host; none: webhooks off)."""
    ignore_unsupported_fields: bool = False
    """Chat fields that would change the answer and are not supported are reported as
    ignored instead of refused (--ignore-unsupported-fields; :mod:`apbv.openai.chat_fields`)."""
    metrics_prefix: str = "apbv"
    """The metric names' prefix (--metrics-prefix): ``apbv:...``, or ``vllm:...``."""
    log_format: str = "text"
    """The log's format (--log-format, :mod:`apbv.serve.log_format`); ``json`` routes
    uvicorn's own lines through it too."""


class Server:
    """The routes, the router and the replicas (each a rank group with its queue and worker)."""

    def __init__(self, cfg: RuntimeConfig, groups: list[RankGroup], processor: Processor,
                 options: ServerOptions,
                 admissions: list[Admission] | None = None):
        self.cfg, self.processor, self.opt = cfg, processor, options
        self.started = int(time.time())
        """The server's start (Unix seconds): ``created`` in ``/v1/models``."""
        self.max_model_len = max_model_len(options.limits, checkpoint_positions(
            None if cfg is None else cfg.model.path))
        self.metrics = Metrics(options.model_name, options.metrics_prefix,
                               cfg is not None and cfg.cache.vision_gb > 0, self.max_model_len)
        if admissions is None:
            admissions = [Admission(options.max_queue) for _ in groups]
        self.front = Front(cfg, options.limits, options.policy, options.model_name, self.metrics,
                           processor, options.api_key, options.webhook_hosts)
        self.replicas = [Replica(i, g, a, self.metrics, self.front.observe)
                         for i, (g, a) in enumerate(zip(groups, admissions, strict=True))]
        for replica in self.replicas:
            replica.peers = self.replicas
        self.affinity = len(groups) > 1 and cfg.cache.vision_gb > 0
        self.workers: list[asyncio.Task] = []
        self.streams: Streams | None = None
        self.watches: Watches | None = None
        if options.streams is not None:
            self.streams, self.watches = live_streams(self.front, self.replicas, options.streams)
        self.downloads: set[asyncio.Task] = set()
        """The remote videos downloading now (:meth:`_fetch`)."""
        self.closing = False
        self.checks = ThreadPoolExecutor(min(32, (os.cpu_count() or 1) + 4),
                                         thread_name_prefix="apbv-checks")
        """Threads for a request's parsing and probing: the file checks of chat requests,
        never a download (those run on the event loop) nor a rank call."""
        self.app = HttpGuard(self._routes(), options.hosts, options.read_timeout_s,
                             refused=self._count_refused, on_shut=self.shutting)

    @property
    def status(self) -> str:
        return overall_status(self.replicas)

    @asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        if self.opt.log_format == "json":  # uvicorn configured its loggers as it started
            log_format.adopt_uvicorn()
        self.workers = [asyncio.ensure_future(r.boot()) for r in self.replicas]
        if self.streams is not None:
            self.workers.append(asyncio.ensure_future(self.streams.registry.sweep()))
        try:
            yield
        finally:
            self.app.shut()  # whatever is still in flight is answered 503
            if self.watches is not None:  # their webhooks' last events, briefly
                await self.watches.finished(SHUTDOWN_WEBHOOKS_S)
            for worker in self.workers:
                worker.cancel()
            await asyncio.gather(*self.workers, return_exceptions=True)
            await asyncio.gather(*(asyncio.to_thread(r.group.stop) for r in self.replicas))
            self.checks.shutdown(wait=False, cancel_futures=True)  # their clients are gone

    def shutting(self) -> None:
        """The server begins to stop: downloads end (:meth:`stop_downloads`), every stream
        ends (``server shutdown``, told to its event streams and webhooks) and every event
        stream ends after its last event."""
        self.stop_downloads()
        if self.streams is not None:
            self.streams.registry.shutdown()
        if self.watches is not None:
            self.watches.hub.close()

    def stop_downloads(self) -> None:
        """Shutting down: every download ends now (its client gets a 503), none begins."""
        self.closing = True
        for task in self.downloads:
            task.cancel()

    async def _fetch(self, url: str) -> Held:
        """The stored download of ``url`` (:func:`fetch_media`), as a task that
        :meth:`stop_downloads` ends."""
        if self.closing:
            raise ClientError(503, "the server is shutting down")
        task = asyncio.ensure_future(fetch_media(url, self.opt.policy))
        self.downloads.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and current is not None and not current.cancelling():
                raise ClientError(503, "the server is shutting down: the remote video's "
                                       "download was stopped") from None
            raise
        finally:
            self.downloads.discard(task)

    async def _checked(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on the request-check threads (:attr:`checks`)."""
        return await asyncio.get_running_loop().run_in_executor(
            self.checks, functools.partial(fn, *args, **kwargs))

    def _count_refused(self, status: int) -> None:
        if status < 500 or status == 503:
            self.metrics.requests.labels(f"refused_{status}").inc()

    async def chat(self, request: Request) -> Response:
        self.front.authorize(request)
        raw = await self.front.read_body(request, data=True)
        call = await self._checked(api.parse_chat, decode_json(raw), self.cfg, self.opt.limits,
                                   self.opt.policy, self.opt.model_name,
                                   self.opt.ignore_unsupported_fields, body_bytes=len(raw))
        if call.remote is not None:
            call = api.with_download(call, await self._fetch(call.remote))
        try:
            measured = await self._checked(api.check_request, call.request, self.opt.limits,
                                           self.processor, self.replicas[0].group.world_size)
            replica = pick(self.replicas, call.request, self.affinity)
            job = replica.admission.admit(call, measured, sse=call.sse,
                                          max_tokens=call.request.max_new_tokens *
                                          call.request.n)
        except BaseException:
            discard(call.downloaded)
            raise
        cid = responses.completion_id()
        job.replica, job.name = replica, cid
        headers = {}
        if call.ignored:  # accepted, not acted on (as vLLM): said in a header and the log
            named = [name[:100] for name in call.ignored[:IGNORED_SHOWN]]
            log.warning("%s: ignored the request field(s) %s", cid, named)
            headers["X-Ignored-Fields"] = json.dumps(named)
        if call.sse:
            response = self.front.respond(job, cid, request, call.model,
                                          call.request.stop_texts,
                                          include_usage=call.include_usage)
            response.headers.update(headers)
            return response
        result, wait = await self.front.outcome(job, request)
        return JSONResponse(responses.completion(call, cid, result, wait, replica.index,
                                           self.processor.tokenizer), headers=headers)

    def _routes(self) -> FastAPI:
        app = FastAPI(title="apbv", version=package_version(), docs_url="/docs",
                      redoc_url=None, openapi_url="/openapi.json", lifespan=self.lifespan)

        @app.exception_handler(ClientError)
        async def client_error(_: Request, exc: ClientError) -> JSONResponse:
            self._count_refused(exc.status)
            return JSONResponse(error_body(exc.status, exc.message, exc.param),
                                status_code=exc.status)

        @app.post("/v1/chat/completions", openapi_extra={"requestBody": {
            "required": True,
            "content": {"application/json": {"schema": ChatBody.model_json_schema()}}}})
        async def chat(request: Request) -> Response:
            """An OpenAI chat completion about one video (the body's schema: ChatBody); the
            body is read and checked by the server itself (strict JSON, --max-body-bytes)."""
            return await self.chat(request)

        @app.get("/v1/models")
        async def models(request: Request) -> dict:
            self.front.authorize(request)
            return {"object": "list", "data": [model_card(
                self.opt.model_name, self.started, self.max_model_len,
                family_of(self.cfg.model.path).name)]}

        @app.get("/version")
        async def version() -> dict:
            return {"version": package_version()}

        @app.get("/health")
        async def health() -> JSONResponse:
            for replica in self.replicas:  # a rank's process gone: degraded at once
                replica.check_pids()
            replicas = [r.describe() for r in self.replicas]
            return JSONResponse({"status": self.status,
                                 "world_size": self.replicas[0].group.world_size,
                                 "queued": sum(r["queued"] for r in replicas),
                                 "rank_pids": [p for r in replicas for p in r["rank_pids"]],
                                 "replicas": replicas},
                                status_code=200 if self.status == "ready" else 503)

        @app.get("/metrics")
        async def metrics(request: Request) -> Response:
            if self.opt.protect_metrics:
                self.front.authorize(request)
            self.metrics.count_load(self.replicas, self._stream_load())
            return Response(generate_latest(self.metrics.registry),
                            media_type=CONTENT_TYPE_LATEST)

        app.add_middleware(RequestIdMiddleware)
        page.register(app, self.front)
        if self.streams is not None:
            self.streams.register(app)
        if self.watches is not None:
            self.watches.register(app)
        return app

    def _stream_load(self) -> StreamLoad | None:
        """What the metrics count of the live streams at a scrape (None: not served)."""
        if self.streams is None or self.watches is None:
            return None
        registry = self.streams.registry
        return StreamLoad(len(registry.live), sum(len(sw.watches)
                                                  for sw in self.watches.of.values()),
                          registry.opt.budget_bytes,
                          tuple(registry.held(replica) for replica in self.replicas),
                          registry.pushes_held)


def live_streams(front: Front, replicas: list[Replica],
                 options: StreamOptions) -> tuple[Streams, Watches]:
    """The live streams' routes over a new registry of ``replicas`` and, beside them, the
    watches: the registry's listener, made by the registry as it is built."""
    registry = StreamRegistry(replicas, front.limits, options,
                              listener=lambda registry: Watches(front, registry))
    watches = registry.listener
    assert isinstance(watches, Watches), "the registry's listener is the watches it made"
    return Streams(front, registry), watches
