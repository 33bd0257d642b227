"""One access log line per HTTP request, refusals included.

:class:`AccessEntry` gives each request its id (the client's ``X-Request-Id`` when usable,
else a new one: :mod:`apbv.openai.request_id`, whose middleware then uses the same id), sent
back in the ``X-Request-Id`` header (one, whichever layer answers), and logs one line when the
request ends, at INFO below 400 and WARNING from 400 on (logger ``apbv.access``)::

    3f9a0c1d2e4b4c7e9a0b1c2d3e4f5a6b POST /v1/chat/completions 400 0.004 s: max_completion_...

the reason being the JSON error's message of a refusal (:func:`apbv.openai.policy.error_body`),
cut at :data:`REASON_CHARS`. What the client wrote (the path, a message quoting it) is logged
escaped (no control character reaches the log), and an answer that never started (the client
left, the handler failed) is logged with status ``-``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable

from apbv.openai import request_id

log = logging.getLogger("apbv.access")

REASON_CHARS = 200
"""Characters of a refusal's message in its line at most."""
PATH_CHARS = 200
"""Characters of the request's path in its line at most."""
_BODY_READ = 16384
"""Bytes of an error body looked at for its message at most."""

Send = Callable[[dict], Awaitable[None]]


def escaped(text: str, limit: int) -> str:
    """``text`` cut at ``limit`` characters, control and non-ASCII characters escaped as in
    JSON (one log line, whatever the client sent)."""
    return json.dumps(text[:limit] + ("..." if len(text) > limit else ""))[1:-1]


class AccessEntry:
    """One request's line: :meth:`send` wraps the ASGI send (the id header, the status, a
    refusal's reason), :meth:`done` logs it."""

    def __init__(self, scope: dict, send: Send) -> None:
        given = next((value for name, value in scope.get("headers", ())
                      if name.lower() == request_id.HEADER.encode()), None)
        self.id = request_id.accepted(None if given is None else given.decode("latin-1")) \
            or request_id.new_id()
        scope[request_id.SCOPE_KEY] = self.id  # the app's middleware keeps this id
        self.method = str(scope.get("method", "?"))[:16]
        self.path = str(scope.get("path", ""))
        self.started = time.monotonic()
        self.status: int | None = None
        self.reason: str | None = None
        self._send = send
        self._error = b""

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            header = request_id.HEADER.encode()
            headers = [h for h in message.get("headers", []) if h[0].lower() != header]
            message = {**message, "headers": [*headers, (header, self.id.encode())]}
        elif message["type"] == "http.response.body" and self.status is not None and \
                self.status >= 400 and self.reason is None and len(self._error) < _BODY_READ:
            self._error += message.get("body", b"")[:_BODY_READ]
            if not message.get("more_body", False) or len(self._error) >= _BODY_READ:
                self.reason = _message_of(self._error)
        await self._send(message)

    def done(self) -> None:
        status = "-" if self.status is None else str(self.status)
        reason = f": {escaped(self.reason, REASON_CHARS)}" if self.reason else ""
        level = logging.INFO if self.status is not None and self.status < 400 else \
            logging.WARNING
        log.log(level, "%s %s %s %s %.3f s%s", self.id, escaped(self.method, 16),
                escaped(self.path, PATH_CHARS), status, time.monotonic() - self.started, reason)


def _message_of(body: bytes) -> str:
    """The ``error.message`` of a JSON error body, or '' when it is none."""
    try:
        value = json.loads(body)
        message = value["error"]["message"]
    except (ValueError, TypeError, KeyError):
        return ""
    return message if isinstance(message, str) else ""
