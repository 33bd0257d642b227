"""The HTTP edge of the server: the Host check, read deadlines, answers at shutdown.

:class:`HttpGuard` wraps the FastAPI app (pure ASGI): it refuses a request whose ``Host``
header names neither the bound address nor an ``--allow-host`` entry (421: a DNS-rebinding
page sends its own name), gives the request body ``--read-timeout-s`` seconds from the end of
the head (408, connection closed), and at shutdown answers every request still in flight with a
503 JSON error (a stream of server-sent events gets that error as its last event). The head of
each request has the same deadline, counted from the connection's start or its previous
response, in :class:`TimedH11Protocol` (uvicorn has no such timeout of its own): a slowloris
connection is closed. Every request gets one access log line (:mod:`apbv.serve.access_log`).
:func:`serve` runs the guarded app with uvicorn.

The head's deadline cannot be ASGI middleware (the app is called once the head has arrived),
so :class:`TimedH11Protocol` subclasses uvicorn's h11 protocol, which is not uvicorn's public
API: ``pyproject.toml`` caps uvicorn at the minor series tested, and
``tests/serve/scheduler/test_head_deadline.py`` checks the class against the installed uvicorn in a
second (docs/deployment.md).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from apbv.openai.policy import ClientError, error_body
from apbv.serve.access_log import AccessEntry

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("0.0.0.0", "::", "")
SHUTDOWN_MESSAGE = "the server is shutting down; retry on its next start"
EVENTS_END_S = 1.0
"""At shutdown, seconds an event stream already sending may take to end by itself."""
log = logging.getLogger("apbv.serve")


def split_host(value: str) -> tuple[str, int | None]:
    """(lower-case host without brackets, port or None) of a Host header or ``--allow-host``
    entry; ValueError if the port is not a number."""
    value = value.strip().lower()
    if value.startswith("["):  # [v6]:port
        host, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
        if rest and not rest.startswith(":"):
            raise ValueError(f"malformed host {value[:80]!r}")
    elif value.count(":") == 1:
        host, _, port = value.partition(":")
    else:  # a name, an IPv4 address, or a bare IPv6 address
        host, port = value, ""
    if port and not port.isdigit():
        raise ValueError(f"the port of {value[:80]!r} is not a number")
    return host, int(port) if port else None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class HostRule:
    """Which ``Host`` headers a request may carry.

    Bound to loopback: ``localhost``, ``127.0.0.1`` and ``[::1]`` with the bound port. Bound
    to one address: that address with the port. Bound to every interface (``0.0.0.0`` or
    ``::``): any IP address with the port, ``localhost`` and this machine's host name (a name
    is what a rebinding page needs, an address is not). ``allowed`` (``--allow-host``) adds
    names: ``NAME`` (any port) or ``NAME:PORT``; ``*`` turns the check off. A port of 80
    may be left out of the header.
    """

    bound: str
    port: int
    allowed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for entry in self.allowed:
            if entry != "*":
                split_host(entry)  # ValueError now, not at the first request

    def allows(self, header: str | None) -> bool:
        if "*" in self.allowed:
            return True
        if not header:
            return False
        try:
            host, port = split_host(header)
        except ValueError:
            return False
        for entry in self.allowed:
            name, entry_port = split_host(entry)
            if host == name and (entry_port is None or entry_port == (port or 80)):
                return True
        if (port or 80) != self.port:
            return False
        bound = self.bound.strip("[]").lower()
        if bound in LOOPBACK_NAMES or bound.startswith("127."):
            return host in LOOPBACK_NAMES
        if bound in WILDCARDS:
            return _is_ip(host) or host == "localhost" or host == socket.gethostname().lower()
        return host == bound

    def describe(self) -> str:
        return (f"this server answers Host {self.bound}:{self.port}"
                + (f" and {', '.join(self.allowed)}" if self.allowed else "")
                + "; add a name with --allow-host")


class HttpGuard:
    """ASGI wrapper of ``app``: Host check, body read deadline, 503 JSON at shutdown.

    ``hosts`` None: no Host check (an app mounted in a test client); ``read_timeout_s`` None:
    no body deadline. :meth:`shut` (called when the server begins to stop) ends every request
    in flight: its handler is cancelled and the client gets a 503 JSON error, or, when the
    response already started (server-sent events), a last ``data: {"error": ...}`` event and
    ``[DONE]``. ``refused(status)`` is called for each request the guard itself refuses;
    ``on_shut()`` when :meth:`shut` begins (the server ends its downloads there).
    """

    def __init__(self, app: Any, hosts: HostRule | None = None,
                 read_timeout_s: float | None = None,
                 refused: Callable[[int], None] | None = None,
                 on_shut: Callable[[], None] | None = None):
        self.app, self.hosts, self.read_timeout_s = app, hosts, read_timeout_s
        self.refused = refused or (lambda status: None)
        self.on_shut = on_shut or (lambda: None)
        self.closing = False
        self._waiters: set[asyncio.Future] = set()
        """One per request in flight, resolved by :meth:`shut` (a future of the request's own
        loop: a test client may run each request on a loop of its own)."""

    def shut(self) -> None:
        self.closing = True
        self.on_shut()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] != "http":  # lifespan (and websockets, which no route serves)
            await self.app(scope, receive, send)
            return
        entry = AccessEntry(scope, send)  # one access log line, whatever the answer
        try:
            await self._guarded(scope, receive, entry.send)
        finally:
            entry.done()

    async def _guarded(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if self.hosts is not None:
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if not self.hosts.allows(host):
                shown = "none" if host is None else repr(host[:80])
                await self._answer(send, 421, f"Host {shown} is not this server's: "
                                              f"{self.hosts.describe()}")
                return
        if self.closing:
            await self._answer(send, 503, SHUTDOWN_MESSAGE)
            return
        exchange = _Exchange(receive, send, self.read_timeout_s)
        app = asyncio.ensure_future(self.app(scope, exchange.receive, exchange.send))
        closing = asyncio.get_running_loop().create_future()
        self._waiters.add(closing)
        try:
            await asyncio.wait([app, closing], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            app.cancel()
            raise
        finally:
            self._waiters.discard(closing)
        if not app.done() and exchange.event_stream:  # it may end itself (its last event)
            await asyncio.wait([app], timeout=EVENTS_END_S)
        if app.done():
            app.result()  # its exception, if any, as uvicorn would have seen it
            return
        app.cancel()  # shutting down: the handler stops where it waits
        await asyncio.wait([app], timeout=2.0)
        if not exchange.started:
            await self._answer(send, 503, SHUTDOWN_MESSAGE)
        elif not exchange.finished:
            if exchange.event_stream:
                event = json.dumps({"error": {"message": SHUTDOWN_MESSAGE, "code": 503}})
                await send({"type": "http.response.body", "more_body": False,
                            "body": f"data: {event}\n\ndata: [DONE]\n\n".encode()})
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _answer(self, send: Callable[[dict], Awaitable[None]], status: int,
                      message: str) -> None:
        self.refused(status)
        body = json.dumps(error_body(status, message)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})


class _Exchange:
    """One request's receive (the body within its deadline) and send (what was sent)."""

    def __init__(self, receive: Callable[[], Awaitable[dict]],
                 send: Callable[[dict], Awaitable[None]], timeout_s: float | None):
        self._receive, self._send, self.timeout_s = receive, send, timeout_s
        loop = asyncio.get_running_loop()
        self.deadline = None if timeout_s is None else loop.time() + timeout_s
        self.body_done = self.timed_out = self.started = self.finished = False
        self.event_stream = False

    async def receive(self) -> dict:
        if self.body_done or self.deadline is None:
            return await self._receive()
        left = self.deadline - asyncio.get_running_loop().time()
        try:
            message = await asyncio.wait_for(self._receive(), max(left, 0.0))
        except TimeoutError:
            self.timed_out = True
            raise ClientError(408, f"the request body did not arrive within {self.timeout_s:g} "
                                   "s of its head (--read-timeout-s)") from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.body_done = True
        return message

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            self.event_stream = any(k.lower() == b"content-type" and
                                    v.startswith(b"text/event-stream") for k, v in headers)
            if self.timed_out:  # the rest of the body is not read: the connection ends here
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await self._send(message)
        if message["type"] == "http.response.start":
            self.started = True
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head: ``head_timeout_s`` after
    the connection is made or its previous response ended, a connection that is not in the
    middle of a request the app handles is closed (a 408 JSON first when part of a head came).
    Set ``head_timeout_s`` on a subclass (:func:`timed_protocol`)."""

    head_timeout_s: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_expired)

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # the app has this request; the body's deadline is HttpGuard's
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            body = json.dumps(error_body(408, f"the request head did not arrive within "
                                              f"{self.head_timeout_s:g} s (--read-timeout-s)"))
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: "
                                 b"application/json\r\nconnection: close\r\ncontent-length: "
                                 + str(len(body)).encode() + b"\r\n\r\n" + body.encode())
        self.transport.close()


def timed_protocol(head_timeout_s: float) -> type[TimedH11Protocol]:
    return type("TimedH11Protocol", (TimedH11Protocol,), {"head_timeout_s": head_timeout_s})


def serve(guard: HttpGuard, host: str, port: int, read_timeout_s: float,
          graceful_s: float = 5.0) -> None:
    """Run ``guard`` with uvicorn on ``host:port`` until SIGINT/SIGTERM; the guard's
    :meth:`HttpGuard.shut` runs as the shutdown begins (before uvicorn waits for the requests
    in flight, which then end at once)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            guard.shut()
            await super().shutdown(sockets)

    config = uvicorn.Config(guard, host=host, port=port, log_level="warning",
                            http=timed_protocol(read_timeout_s),
                            timeout_graceful_shutdown=int(graceful_s))
    server = Server(config)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it handled again once it is done
        pass
    if not server.started:
        raise SystemExit(1)

