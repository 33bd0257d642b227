"""Every request leaves one access log line (status, reason, request id), refusals included,
and a client that leaves before its first token leaves no asyncio error behind."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time

import pytest

pytest.importorskip("fastapi")

from apbv.openai.policy import ClientError  # noqa: E402
from apbv.serve.http_guard import HostRule, HttpGuard  # noqa: E402


def _scope(path: str = "/v1/chat/completions", host: str = "127.0.0.1:8000") -> dict:
    return {"type": "http", "method": "POST", "path": path,
            "headers": [(b"host", host.encode())]}


async def _app(scope: dict, receive, send) -> None:
    """200 for /ok, a 400 JSON error for /bad, a failure (no answer) for /boom."""
    if scope["path"] == "/boom":
        raise RuntimeError("the handler failed")
    ok = scope["path"] == "/ok"
    body = b"{}" if ok else json.dumps({"error": {
        "message": "max_completion_tokens and max_tokens differ ([4, 2000]): give one",
        "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 200 if ok else 400, "headers": []})
    await send({"type": "http.response.body", "body": body})


def _run(guard: HttpGuard, scope: dict) -> list[dict]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}"}

    async def send(message: dict) -> None:
        sent.append(message)

    try:
        asyncio.run(guard(scope, receive, send))
    except RuntimeError:
        pass
    return sent


def test_one_line_per_request_with_status_reason_and_id(caplog):
    guard = HttpGuard(_app, HostRule("127.0.0.1", 8000))
    caplog.set_level(logging.INFO, logger="apbv.access")
    answers = [_run(guard, _scope("/ok")), _run(guard, _scope("/bad")),
               _run(guard, _scope("/ok", host="evil.example")),  # the guard's own refusal
               _run(guard, _scope("/boom")),
               _run(guard, _scope("/ok\n2026 INFO forged line\u202e"))]
    lines = [r for r in caplog.records if r.name == "apbv.access"]
    assert len(lines) == 5, [r.getMessage() for r in lines]
    texts = [r.getMessage() for r in lines]
    ids = [dict(a[0]["headers"])[b"x-request-id"].decode() for a in answers if a]
    assert len(ids) == 4 and len(set(ids)) == 4 and all(t.startswith(i) for t, i in
                                                          zip(texts[:3], ids, strict=False))
    assert " POST /ok 200 " in texts[0] and lines[0].levelno == logging.INFO
    assert " 400 " in texts[1] and texts[1].endswith(
        ": max_completion_tokens and max_tokens differ ([4, 2000]): give one")
    assert lines[1].levelno == logging.WARNING
    assert " 421 " in texts[2] and "Host 'evil.example' is not this server's" in texts[2]
    assert " /boom - " in texts[3] and lines[3].levelno == logging.WARNING
    assert "\n" not in texts[4] and "\\n2026 INFO forged line\\u202e 400 " in texts[4]


def test_a_client_gone_before_its_first_token_leaves_no_unretrieved_error():
    """The SSE answer's generator closed before any token; the replica then sets the job's
    499 on a future nobody awaits (what asyncio logged as "Future exception was never
    retrieved")."""
    from types import SimpleNamespace

    from apbv.serve.front.front import Front
    from apbv.serve.front.sse import _events
    from apbv.serve.scheduler.admission import Job

    errors: list[dict] = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        job = Job(op=None, call=None, predicted_s=1.0, key=(0.0, 0), tokens=asyncio.Queue())
        job.started = time.monotonic()  # running: not dropped, cancelled
        fake = SimpleNamespace(tokenizer=None, drop=lambda j: False)
        fake.outcome = lambda job, request: Front.outcome(fake, job, request)  # type: ignore

        class Client:
            async def is_disconnected(self) -> bool:
                return False

        events = _events(fake, job, "chatcmpl-x", Client(), "m", (), False, {})
        assert b"assistant" in await events.__anext__()
        await events.aclose()  # the client left
        assert job.cancel.is_set()
        job.future.set_exception(ClientError(499, "the client went away"))
        await asyncio.sleep(0.05)
        del job, events
        gc.collect()
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert not errors, [str(e.get("message")) for e in errors]
