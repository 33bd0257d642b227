"""The :class:`Front`: what a route needs of the server, and nothing more.

The chat, stream and watch routes and the page all take one ``Front`` (not the server that
built them): the config, the limits and media policy, the model's name and the webhook hosts;
the API key check (:meth:`Front.authorize`), a body read within ``--max-body-bytes``
(:meth:`Front.read_json`), a result's figures observed (:meth:`Front.observe`), and the answer
of an admitted job, whole (:meth:`Front.outcome`) or as server-sent events
(:meth:`Front.respond`, :mod:`apbv.serve.front.sse`).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from apbv.openai.bodies import check_content_type, decode_json
from apbv.openai.download import discard
from apbv.openai.policy import ClientError, Limits, MediaPolicy
from apbv.serve.front import sse

if TYPE_CHECKING:
    from apbv.config import RuntimeConfig
    from apbv.engine.request import Result
    from apbv.openai.detok import Tokenizer
    from apbv.serve.front.metrics import Metrics
    from apbv.serve.scheduler.admission import Job


class Processor(Protocol):
    """The model's processor, as far as the routes use it: its tokenizer."""

    @property
    def tokenizer(self) -> Tokenizer: ...


@dataclass
class Front:
    """What every route of one server shares (see the module docstring)."""

    cfg: RuntimeConfig
    limits: Limits
    policy: MediaPolicy
    model_name: str
    metrics: Metrics
    processor: Processor
    api_key: str | None = None
    webhook_hosts: tuple[str, ...] = ()
    """The hosts watches may post events to (--allow-webhook-host; none: webhooks off)."""

    @property
    def tokenizer(self) -> Tokenizer:
        return self.processor.tokenizer

    def authorize(self, request: Request) -> None:
        """401 unless the request carries the API key (when the server has one)."""
        key = self.api_key
        if not key:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise ClientError(401, "missing or wrong API key (Authorization: Bearer KEY; "
                                   "set with --api-key or APBV_API_KEY)")

    async def read_json(self, request: Request) -> object:
        """The request's JSON body (:mod:`apbv.openai.bodies`: application/json only, strictly
        decoded), within --max-body-bytes."""
        return decode_json(await self.read_body(request))

    async def read_body(self, request: Request, data: bool = False) -> bytes:
        """The request's body bytes if it is JSON, within --max-body-bytes; with ``data`` (a
        chat body, whose ``data:`` URLs :func:`apbv.openai.chat.parse_chat` bounds by
        --max-data-bytes and the rest by --max-body-bytes), within both limits' sum."""
        check_content_type(request.headers.get("content-type"))
        limits = self.limits
        limit = limits.max_body_bytes + (limits.max_data_bytes if data else 0)
        flag = "max-body-bytes" + (" plus --max-data-bytes" if data else "")
        declared = request.headers.get("content-length")
        if declared and declared.isdigit():
            limits.check("body", int(declared), limit, flag, "the request body")
        body = b""
        async for piece in request.stream():
            body += piece
            limits.check("body", len(body), limit, flag, "the request body")
        return body

    def observe(self, result: Result) -> None:
        """A result's TTFT and stage times, into the metrics."""
        self.metrics.ttft.observe(result.ttft_s)
        for stage, seconds in result.seconds.items():
            self.metrics.stage.labels(stage).observe(seconds)

    def drop(self, job: Job) -> bool:
        """Drop a job still waiting (its download deleted); False if it already started."""
        if job.replica.admission.drop(job):
            discard(job.downloaded)
            self.metrics.finished(job, "disconnected")
            return True
        return False

    async def outcome(self, job: Job, request: Request) -> tuple[Result, float]:
        """The job's outcome; a client gone while its job is still queued drops the job, and
        one gone while it runs cancels its decode (the ranks stop at the next token)."""
        try:
            while True:
                done, _ = await asyncio.wait([job.future], timeout=0.25)
                if done:
                    return job.future.result()
                if not job.cancel.is_set() and await request.is_disconnected():
                    if job.started is None and self.drop(job):
                        raise ClientError(499, "the client disconnected while queued")
                    job.cancel.set()
        except asyncio.CancelledError:  # the handler itself was cancelled: nobody awaits it
            sse.retrieve_later(job.future)
            raise

    def respond(self, job: Job, cid: str, request: Request, model: str,
                stop_texts: tuple[str, ...] = (), include_usage: bool = False,
                extra: Mapping[str, object] | None = None) -> StreamingResponse:
        """The answer of a job admitted with ``sse``, as chat.completion.chunk server-sent
        events (:func:`apbv.serve.front.sse.respond`)."""
        return sse.respond(self, job, cid, request, model, stop_texts, include_usage, extra)
