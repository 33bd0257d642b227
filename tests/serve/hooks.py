"""A webhook receiver for the tests: a thread serving on 127.0.0.1 that keeps each posted JSON
body and answers 204 (the servers under test allow that host by IP)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Hooks:
    url: str
    received: list[dict] = field(default_factory=list)
    """Every posted body, in arrival order."""


@contextlib.contextmanager
def webhook_receiver() -> Iterator[Hooks]:
    hooks = Hooks("")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802  # http.server's name
            hooks.received.append(json.loads(self.rfile.read(
                int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    hooks.url = f"http://127.0.0.1:{httpd.server_address[1]}/hook"
    try:
        yield hooks
    finally:
        httpd.shutdown()
