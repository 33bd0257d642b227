"""Server-sent events of a streamed answer: OpenAI's ``chat.completion.chunk`` events as the
tokens of a job arrive (each with its tokens' logprobs when asked), then the last chunk (finish
reason, the logprobs not sent yet, the ``apbv`` block), the
usage in its own event when asked, and ``[DONE]``.

:func:`respond` is the response of one job admitted with ``sse`` (a chat request's or a live
stream's ask); the text of each event comes from :class:`~apbv.openai.detok.IncrementalText`,
so each token costs the same however long the answer already is. A client that leaves ends the
events: its job is dropped while it waits or cancelled while it runs, and nothing is raised
past the generator (no asyncio error in the log).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from apbv.openai import responses
from apbv.openai.detok import IncrementalText, Tokenizer
from apbv.openai.policy import ClientError, error_body

if TYPE_CHECKING:
    from apbv.engine.request import Result
    from apbv.serve.scheduler.admission import Job

DONE = b"data: [DONE]\n\n"


class Answering(Protocol):
    """What :func:`respond` needs of its caller (the :class:`~apbv.serve.front.front.Front`):
    the tokenizer, a job's outcome as its client waits, and dropping a job still queued."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    async def outcome(self, job: Job, request: Request) -> tuple[Result, float]: ...

    def drop(self, job: Job) -> bool: ...


def event(payload: dict) -> bytes:
    """One server-sent event holding ``payload`` as JSON."""
    return f"data: {json.dumps(payload)}\n\n".encode()


def respond(front: Answering, job: Job, cid: str, request: Request, model: str,
            stop_texts: tuple[str, ...] = (), include_usage: bool = False,
            extra: Mapping[str, object] | None = None) -> StreamingResponse:
    """The answer of ``job`` (admitted with ``sse``) as server-sent events: text that may begin
    one of ``stop_texts`` is held back until it is known not to; ``extra`` adds fields to the
    last chunk's ``apbv`` block; ``include_usage``: the usage follows in its own event with no
    choices."""
    return StreamingResponse(_events(front, job, cid, request, model, stop_texts,
                                     include_usage, dict(extra or {})),
                             media_type="text/event-stream")


async def _events(front: Answering, job: Job, cid: str, request: Request, model: str,
                  stop_texts: tuple[str, ...], include_usage: bool,
                  extra: dict[str, object]) -> AsyncIterator[bytes]:
    """The events of :func:`respond`."""
    tokenizer = front.tokenizer
    sent: list[str] = []
    waiter = asyncio.ensure_future(front.outcome(job, request))
    try:
        yield event(responses.chunk(model, cid, {"role": "assistant", "content": ""}))
        records: list[dict | None] = []  # of the tokens read so far (None: not recorded)
        given = 0  # records sent with the text
        try:
            async for piece in deltas(job, waiter, tokenizer, stop_texts, records):
                sent.append(piece)
                fresh = [r for r in records[given:] if r is not None]
                given = len(records)
                yield event(responses.chunk(model, cid, {"content": piece}, None,
                                            responses.logprobs(fresh or None, tokenizer)))
            result, wait = await waiter
        except ClientError as exc:
            yield event(error_body(exc.status, exc.message, exc.param))
            yield DONE
            return
        text = "".join(sent)
        if result.answer.startswith(text) and len(result.answer) > len(text):
            yield event(responses.chunk(model, cid, {"content": result.answer[len(text):]}))
        sent_records = sum(r is not None for r in records[:given])
        rest = None if result.logprobs is None else result.logprobs[sent_records:]
        yield event(responses.chunk(model, cid, {}, result.finish_reason,
                                    responses.logprobs(rest or None, tokenizer),
                                    apbv={**responses.apbv_block(result, wait,
                                                                 job.replica.index),
                                          **extra}))
        if include_usage:
            yield event(responses.usage_chunk(model, cid, result))
        yield DONE
    finally:  # the client went away: a job still waiting is dropped, a running one stopped
        if job.started is None:
            front.drop(job)
        if not job.future.done():
            job.cancel.set()
            retrieve_later(job.future)  # its 499 (or error) comes after the waiter is gone
        if not waiter.done():
            waiter.cancel()
        elif not waiter.cancelled():
            waiter.exception()  # retrieved: asyncio logs no "never retrieved" error


def retrieve_later(future: asyncio.Future) -> None:
    """Retrieve ``future``'s exception once it is set, for a future nobody awaits any more
    (its client left; the replica logged the outcome): asyncio then logs no "Future exception
    was never retrieved" error."""
    future.add_done_callback(lambda done: None if done.cancelled() else done.exception())


async def deltas(job: Job, waiter: asyncio.Future, tokenizer: Tokenizer,
                 stop_texts: tuple[str, ...],
                 records: list[dict | None] | None = None) -> AsyncIterator[str]:
    """New text as tokens arrive (:class:`~apbv.openai.detok.IncrementalText`: the same work
    per token however long the answer; held back while it ends inside a UTF-8 sequence or with
    what could begin a stop text; nothing from the first stop text on). ``records`` gets each
    token's logprobs record as it is read (None for a token without one)."""
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
                token = job.tokens.get_nowait()
                if records is not None:
                    records.append(getattr(token, "record", None))
                piece = text.add(token)
                if piece:
                    yield piece
            return
        token = getter.result()
        if records is not None:
            records.append(getattr(token, "record", None))
        piece = text.add(token)
        if piece:
            yield piece
