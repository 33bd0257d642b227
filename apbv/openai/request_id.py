"""``X-Request-Id``: every HTTP request has an id, the client's when it sent a usable one, else
one made here; the response carries it in its ``X-Request-Id`` header, and the server's log
lines about the request name it (:mod:`apbv.serve.log_format`).

A client's id is data, never trusted as more: it is used only when it is 1 to
:data:`MAX_LENGTH` characters among :data:`SAFE_CHARACTERS` (what UUIDs, ULIDs and trace ids
are made of), so it cannot break a log line, a JSON object or a header; any other value is
replaced by a new id (a UUID4's 32 hex digits), and the response says which one was used.
"""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar
from typing import Any

HEADER = "x-request-id"
SCOPE_KEY = "apbv.request_id"
"""Where an outer layer (the access log) puts the id it chose in the ASGI scope."""
MAX_LENGTH = 128
SAFE_CHARACTERS = "A-Z a-z 0-9 . _ - : = + / @"
_SAFE = re.compile(rf"[A-Za-z0-9._\-:=+/@]{{1,{MAX_LENGTH}}}\Z")

_current: ContextVar[str | None] = ContextVar("apbv_request_id", default=None)


def accepted(given: str | None) -> str | None:
    """``given`` when it is a usable request id (see the module docstring), else None."""
    return given if isinstance(given, str) and _SAFE.match(given) else None


def new_id() -> str:
    return uuid.uuid4().hex


def current() -> str | None:
    """The id of the HTTP request being handled in this context, None outside one."""
    return _current.get()


class RequestIdMiddleware:
    """ASGI middleware: sets the request's id (an outer layer's, :data:`SCOPE_KEY`; else the
    client's ``X-Request-Id`` when :func:`accepted`, else :func:`new_id`) for its handling
    (:func:`current`) and adds it to the response's headers, replacing any other."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope.get("headers", ())
                      if name.lower() == HEADER.encode()), None)
        rid = scope.get(SCOPE_KEY) or accepted(None if given is None else
                                                given.decode("latin-1")) or new_id()
        header = (HEADER.encode(), rid.encode())

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", ()) if h[0].lower() != header[0]]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        token = _current.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _current.reset(token)
