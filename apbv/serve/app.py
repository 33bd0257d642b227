"""The HTTP front end: FastAPI routes, API key, the bounded admission queue, metrics.

The metrics keep vLLM's names under an ``apbv:`` prefix with a ``model_name`` label (a vLLM
dashboard reads them), beside apbv's own per-stage and per-replica ones; ``/metrics`` is open
(as vLLM's and SGLang's: keep it behind the network's firewall) unless ``protect_metrics``.

One :class:`Server` owns the replicas (:mod:`apbv.serve.replicas`: R rank groups, each with a
bounded queue and one worker): requests are validated here (media policy, limits; remote media
downloaded on the event loop, the files probed on the server's own request threads, which no
download occupies) before anything reaches a rank, routed to a replica (the one whose vision cache
holds the video, else the least loaded), wait in its queue (FIFO; earliest deadline first for
those with ``deadline_ms``), and its worker hands them to its group one at a time. A lost rank
fails that replica's in-flight request (503 naming the rank), its group is rebuilt, and its
queue is then served; nothing is answered twice.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from apbv import package_version
from apbv.model.families import family_of
from apbv.serve import api, page
from apbv.serve.admission import Admission, Job
from apbv.serve.bodies import check_content_type, decode_json
from apbv.serve.detok import IncrementalText
from apbv.serve.download import Held, discard, fetch_media
from apbv.serve.http_guard import HostRule, HttpGuard, error_body
from apbv.serve.policy import ClientError, Limits, MediaPolicy
from apbv.serve.replicas import Replica, overall_status, pick
from apbv.serve.streams import StreamOptions, Streams

if TYPE_CHECKING:
    from apbv.config import RuntimeConfig
    from apbv.engine.request import Result
    from apbv.serve.group import RankGroup

BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
"""Seconds between two generated tokens (vLLM's inter-token buckets, and longer ones)."""

log = logging.getLogger("apbv.serve")
IGNORED_SHOWN = 32
"""Ignored fields named in the log and the header at most (the response lists them all)."""


class Metrics:
    def __init__(self, model_name: str = "apbv") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        label = ["model_name"]
        # vLLM's metrics, under apbv: (a chat request's, from its admission on)
        self.request_ttft = Histogram("apbv:time_to_first_token_seconds", "Time to first "
                                      "token, queue included", label, buckets=BUCKETS,
                                      registry=r)
        self.e2e = Histogram("apbv:e2e_request_latency_seconds", "Admission to the last token",
                             label, buckets=BUCKETS, registry=r)
        self.request_queue = Histogram("apbv:request_queue_time_seconds", "Time queued before "
                                       "the ranks", label, buckets=BUCKETS, registry=r)
        self.itl = Histogram("apbv:inter_token_latency_seconds", "Time between two generated "
                             "tokens", label, buckets=TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = Counter("apbv:prompt_tokens", "Prompt tokens of answered "
                                     "requests", label, registry=r)
        self.generation_tokens = Counter("apbv:generation_tokens", "Generated tokens", label,
                                         registry=r)
        self.num_running = Gauge("apbv:num_requests_running", "Requests on the ranks", label,
                                 registry=r)
        self.num_waiting = Gauge("apbv:num_requests_waiting", "Requests queued", label,
                                 registry=r)
        # apbv's own
        self.ttft = Histogram("apbv_ttft_seconds", "Time to first token", buckets=BUCKETS,
                              registry=r)
        self.queue_wait = Histogram("apbv_queue_wait_seconds", "Time queued before the ranks",
                                    buckets=BUCKETS, registry=r)
        self.stage = Histogram("apbv_stage_seconds", "Seconds per engine stage", ["stage"],
                               buckets=BUCKETS, registry=r)
        self.requests = Counter("apbv_requests", "Requests by outcome", ["outcome"], registry=r)
        self.cache_hits = Counter("apbv_vision_cache_hits", "Vision-embedding cache hits",
                                  registry=r)
        self.rebuilds = Counter("apbv_group_rebuilds", "Rank-group rebuilds", registry=r)
        self.queue_depth = Gauge("apbv_replica_queue_depth", "Requests waiting per replica",
                                 ["replica"], registry=r)
        self.running = Gauge("apbv_replica_running", "Requests running per replica (0 or 1)",
                             ["replica"], registry=r)
        self.replica_ready = Gauge("apbv_replica_ready", "1 while the replica is ready",
                                   ["replica"], registry=r)
        self.replica_stalled = Gauge("apbv_replica_stalled", "1 while a rank of the replica "
                                     "does not answer (its job ran past its prediction)",
                                     ["replica"], registry=r)
        self.ttft_scale = Gauge("apbv_ttft_model_scale", "Measured / cost-model TTFT learned "
                                "per replica (deadline admission's correction)", ["replica"],
                                registry=r)
        self.decode_s = Gauge("apbv_decode_token_seconds", "Seconds per generated token learned "
                              "per replica (deadline admission's decode time)", ["replica"],
                              registry=r)

    def observe_request(self, job: Job, result: Any) -> None:
        """A chat request's vLLM metrics, once it is answered: its times from its admission
        (``job.enqueued``), the gaps between its tokens' arrivals, its token counts."""
        name, now = self.model_name, time.monotonic()
        started = job.started if job.started is not None else now
        times = job.token_times
        first = times[0] if times else started + result.ttft_s
        self.request_queue.labels(name).observe(started - job.enqueued)
        self.request_ttft.labels(name).observe(first - job.enqueued)
        self.e2e.labels(name).observe(now - job.enqueued)
        for before, after in zip(times, times[1:], strict=False):
            self.itl.labels(name).observe(after - before)
        self.prompt_tokens.labels(name).inc(result.context_len + result.query_len)
        self.generation_tokens.labels(name).inc(len(result.token_ids))

    def count_load(self, replicas: list[Replica]) -> None:
        """Set the running and waiting gauges from the replicas' queues."""
        self.num_running.labels(self.model_name).set(
            sum(r.admission.running is not None for r in replicas))
        self.num_waiting.labels(self.model_name).set(sum(len(r.admission) for r in replicas))


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


class Server:
    """The routes, the router and the replicas (each a rank group with its queue and worker)."""

    def __init__(self, cfg: RuntimeConfig, groups: list[RankGroup], processor: Any,
                 options: ServerOptions,
                 admissions: list[Admission] | None = None):
        self.cfg, self.processor, self.opt = cfg, processor, options
        self.metrics = Metrics(options.model_name)
        if admissions is None:
            admissions = [Admission(options.max_queue) for _ in groups]
        self.replicas = [Replica(i, g, a, self.metrics, self.observe)
                         for i, (g, a) in enumerate(zip(groups, admissions, strict=True))]
        for replica in self.replicas:
            replica.peers = self.replicas
        cache = getattr(cfg, "cache", None)
        self.affinity = len(groups) > 1 and getattr(cache, "vision_gb", 0) > 0
        self.workers: list[asyncio.Task] = []
        self.streams = Streams(self, options.streams) if options.streams is not None else None
        self.downloads: set[asyncio.Task] = set()
        """The remote videos downloading now (:meth:`_fetch`)."""
        self.closing = False
        self.checks = ThreadPoolExecutor(min(32, (os.cpu_count() or 1) + 4),
                                         thread_name_prefix="apbv-checks")
        """Threads for a request's parsing and probing: the file checks of chat requests,
        never a download (those run on the event loop) nor a rank call."""
        self.app = HttpGuard(self._routes(), options.hosts, options.read_timeout_s,
                             refused=self._count_refused, on_shut=self.stop_downloads)

    @property
    def status(self) -> str:
        return overall_status(self.replicas)

    @asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        self.workers = [asyncio.ensure_future(r.boot()) for r in self.replicas]
        if self.streams is not None:
            self.workers.append(asyncio.ensure_future(self.streams.registry.sweep()))
        try:
            yield
        finally:
            self.app.shut()  # whatever is still in flight is answered 503
            for worker in self.workers:
                worker.cancel()
            await asyncio.gather(*self.workers, return_exceptions=True)
            await asyncio.gather(*(asyncio.to_thread(r.group.stop) for r in self.replicas))
            self.checks.shutdown(wait=False, cancel_futures=True)  # their clients are gone

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

    async def _checked(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the request-check threads (:attr:`checks`)."""
        return await asyncio.get_running_loop().run_in_executor(
            self.checks, functools.partial(fn, *args))

    def observe(self, result: Result) -> None:
        self.metrics.ttft.observe(result.ttft_s)
        for stage, seconds in result.seconds.items():
            self.metrics.stage.labels(stage).observe(seconds)
        if getattr(result, "vision_cache_hit", False):
            self.metrics.cache_hits.inc()

    def _drop(self, job: Job) -> bool:
        """Drop a job still waiting (its download deleted); False if it already started."""
        if job.replica.admission.drop(job):
            discard(job.downloaded)
            self.metrics.requests.labels("disconnected").inc()
            return True
        return False

    def _count_refused(self, status: int) -> None:
        if status < 500 or status == 503:
            self.metrics.requests.labels(f"refused_{status}").inc()

    # --- HTTP ---------------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        key = self.opt.api_key
        if not key:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise ClientError(401, "missing or wrong API key (Authorization: Bearer KEY; "
                                   "set with --api-key or APBV_API_KEY)")

    async def read_json(self, request: Request) -> Any:
        """The request's JSON body (:mod:`apbv.serve.bodies`: application/json only, strictly
        decoded), within --max-body-bytes."""
        check_content_type(request.headers.get("content-type"))
        limit = self.opt.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit():
            self.opt.limits.check("body", int(declared), limit, "max-body-bytes",
                                  "the request body in bytes")
        body = b""
        async for piece in request.stream():
            body += piece
            self.opt.limits.check("body", len(body), limit, "max-body-bytes",
                                  "the request body in bytes")
        return decode_json(body)

    async def chat(self, request: Request) -> Response:
        self.authorize(request)
        body = await self.read_json(request)
        call = await self._checked(api.parse_chat, body, self.cfg, self.opt.limits,
                                   self.opt.policy, self.opt.model_name)
        if call.remote is not None:
            call = api.with_download(call, await self._fetch(call.remote))
        try:
            measured = await self._checked(api.check_request, call.request, self.opt.limits,
                                           self.processor)
            replica = pick(self.replicas, call.request, self.affinity)
            job = replica.admission.admit(call, measured, sse=call.sse,
                                          max_tokens=call.request.max_new_tokens)
        except BaseException:
            discard(call.downloaded)
            raise
        cid = api.completion_id()
        job.replica, job.name = replica, cid
        headers = {}
        if call.ignored:  # accepted, not acted on (as vLLM): said in a header and the log
            named = [name[:100] for name in call.ignored[:IGNORED_SHOWN]]
            log.warning("%s: ignored the request field(s) %s", cid, named)
            headers["X-Ignored-Fields"] = json.dumps(named)
        if call.sse:
            response = self.sse(job, cid, request, call.model, call.request.stop_texts,
                                include_usage=call.include_usage)
            response.headers.update(headers)
            return response
        result, wait = await self._wait(job, request)
        self.metrics.observe_request(job, result)
        return JSONResponse(api.completion(call, cid, result, wait, replica.index,
                                           self.processor.tokenizer), headers=headers)

    async def _wait(self, job: Job, request: Request) -> tuple[Any, float]:
        """The job's outcome; a client gone while its job is still queued drops the job, and
        one gone while it runs cancels its decode (the ranks stop at the next token)."""
        while True:
            done, _ = await asyncio.wait([job.future], timeout=0.25)
            if done:
                return job.future.result()
            if not job.cancel.is_set() and await request.is_disconnected():
                if job.started is None and self._drop(job):
                    raise ClientError(499, "the client disconnected while queued")
                job.cancel.set()

    def sse(self, job: Job, cid: str, request: Request, model: str,
            stop_texts: tuple[str, ...] = (), include_usage: bool = False,
            **apbv: Any) -> StreamingResponse:
        """The answer of a job admitted with ``sse``, as chat.completion.chunk server-sent
        events (text that may begin one of ``stop_texts`` is held back until it is known not
        to); ``apbv`` adds fields to the last chunk's ``apbv`` block; ``include_usage``: the
        usage follows in its own event with no choices."""
        return StreamingResponse(self._sse(job, cid, request, model, stop_texts, include_usage,
                                           apbv), media_type="text/event-stream")

    async def _sse(self, job: Job, cid: str, request: Request, model: str,
                   stop_texts: tuple[str, ...], include_usage: bool,
                   extra: dict[str, Any]) -> AsyncIterator[bytes]:
        """The events of :meth:`sse`. A client that leaves ends the generator (its job
        dropped or cancelled): nothing is raised past it, so nothing is logged as an error."""
        tokenizer = self.processor.tokenizer
        sent: list[str] = []

        def event(payload: dict) -> bytes:
            return f"data: {json.dumps(payload)}\n\n".encode()

        waiter = asyncio.ensure_future(self._wait(job, request))
        try:
            yield event(api.chunk(model, cid, {"role": "assistant", "content": ""}))
            try:
                async for piece in self._deltas(job, waiter, tokenizer, stop_texts):
                    sent.append(piece)
                    yield event(api.chunk(model, cid, {"content": piece}))
                result, wait = await waiter
            except ClientError as exc:
                yield event(error_body(exc.status, exc.message, exc.param))
                yield b"data: [DONE]\n\n"
                return
            if isinstance(job.call, api.ChatCall):
                self.metrics.observe_request(job, result)
            text = "".join(sent)
            if result.answer.startswith(text) and len(result.answer) > len(text):
                yield event(api.chunk(model, cid, {"content": result.answer[len(text):]}))
            yield event(api.chunk(model, cid, {}, result.finish_reason,
                                  api.logprobs(result, tokenizer),
                                  apbv={**api.apbv_block(result, wait, job.replica.index),
                                        **extra}))
            if include_usage:
                yield event(api.usage_chunk(model, cid, result))
            yield b"data: [DONE]\n\n"
        finally:  # the client went away: a job still waiting is dropped, a running one stopped
            if job.started is None:
                self._drop(job)
            if not job.future.done():
                job.cancel.set()
            if not waiter.done():
                waiter.cancel()
            elif not waiter.cancelled():
                waiter.exception()  # retrieved: asyncio logs no "never retrieved" error

    @staticmethod
    async def _deltas(job: Job, waiter: asyncio.Future, tokenizer: Any,
                      stop_texts: tuple[str, ...]) -> AsyncIterator[str]:
        """New text as tokens arrive (:class:`~apbv.serve.detok.IncrementalText`: the same
        work per token however long the answer; held back while it ends inside a UTF-8
        sequence or with what could begin a stop text; nothing from the first stop text
        on)."""
        text = IncrementalText(tokenizer, stop_texts)
        assert job.tokens is not None, "a job streams its tokens only when admitted with sse"
        while True:
            assert job.tokens is not None, "a streamed job has a token queue"
            getter = asyncio.ensure_future(job.tokens.get())
            try:
                await asyncio.wait([getter, waiter], return_when=asyncio.FIRST_COMPLETED)
            finally:  # also when the client left meanwhile: no task is left pending
                got = getter.done()
                if not got:
                    getter.cancel()
            if not got:
                while not job.tokens.empty():  # tokens put before the outcome was set
                    piece = text.add(job.tokens.get_nowait())
                    if piece:
                        yield piece
                return
            piece = text.add(getter.result())
            if piece:
                yield piece

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
            "content": {"application/json": {"schema": api.ChatBody.model_json_schema()}}}})
        async def chat(request: Request) -> Response:
            """An OpenAI chat completion about one video (the body's schema: ChatBody); the
            body is read and checked by the server itself (strict JSON, --max-body-bytes)."""
            return await self.chat(request)

        @app.get("/v1/models")
        async def models(request: Request) -> dict:
            self.authorize(request)
            return {"object": "list", "data": [{"id": self.opt.model_name, "object": "model",
                                                "created": 0, "owned_by": "apbv",
                                                "family": family_of(self.cfg.model.path).name}]}

        @app.get("/version")
        async def version() -> dict:
            return {"version": package_version()}

        @app.get("/health")
        async def health() -> JSONResponse:
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
                self.authorize(request)
            self.metrics.count_load(self.replicas)
            return Response(generate_latest(self.metrics.registry),
                            media_type=CONTENT_TYPE_LATEST)

        page.register(app, self)
        if self.streams is not None:
            self.streams.register(app)
        return app
