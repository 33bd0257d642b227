"""The head deadline of :class:`~apbv.serve.http_guard.TimedH11Protocol` against the installed
uvicorn, in a second and without the server: the class subclasses uvicorn's h11 protocol (not
its public API; pyproject caps uvicorn for it), so an uvicorn that changes what it relies on
fails here first. A head that trickles is answered 408 and closed at the deadline; a request
that arrived whole is answered, and its idle connection is closed at the next deadline."""

from __future__ import annotations

import asyncio
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")

from uvicorn.server import ServerState  # noqa: E402

from apbv.serve.http_guard import timed_protocol  # noqa: E402

DEADLINE_S = 0.4


async def _app(scope: dict, receive, send) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _exchange(head: bytes) -> tuple[bytes, float]:
    """Send ``head`` to a fresh protocol server; (all it answered until it closed, seconds)."""
    config = uvicorn.Config(_app, log_level="warning", lifespan="off")
    config.load()
    state = ServerState()
    protocol = timed_protocol(DEADLINE_S)
    server = await asyncio.get_running_loop().create_server(
        lambda: protocol(config=config, server_state=state, app_state={}), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        start = time.monotonic()
        writer.write(head)
        answer = await asyncio.wait_for(reader.read(), DEADLINE_S * 10)  # until closed
        writer.close()
        return answer, time.monotonic() - start
    finally:
        server.close()


def test_a_partial_head_is_answered_408_at_the_deadline() -> None:
    answer, took = asyncio.run(_exchange(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: "))
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer[:200]
    assert b"did not arrive within 0.4 s (--read-timeout-s)" in answer, answer
    assert DEADLINE_S * 0.8 < took < DEADLINE_S + 1.5, f"closed after {took:.2f} s"


def test_a_whole_request_is_answered_then_its_idle_connection_closed() -> None:
    answer, took = asyncio.run(_exchange(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"))
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"ok"), answer
    assert b"408" not in answer, answer
    assert DEADLINE_S * 0.8 < took < DEADLINE_S + 1.5, f"closed after {took:.2f} s"
