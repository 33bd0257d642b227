"""A local media origin for the download tests: files by path (the query ignored), and two slow
answers that never end on their own within a test (a body, or the headers, one byte per
``interval_s``)."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

TRICKLE_BODY = "/trickle-body.mp4"
"""200 with a Content-Length of 1 MB, then the body one byte per interval."""
TRICKLE_HEADERS = "/trickle-headers.mp4"
"""The status line, then a header one byte per interval (the headers never end)."""


class Origin(http.server.ThreadingHTTPServer):
    """``files`` (path -> bytes) on 127.0.0.1, plus :data:`TRICKLE_BODY` and
    :data:`TRICKLE_HEADERS` for at most ``trickle_s`` each (or until :meth:`stop`);
    ``trickles`` counts the slow answers begun."""

    daemon_threads = True

    def __init__(self, files: dict[str, bytes], interval_s: float = 0.5,
                 trickle_s: float = 60.0):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files, self.interval_s, self.trickle_s = files, interval_s, trickle_s
        self.trickles = 0
        self.stopped = threading.Event()
        self._lock = threading.Lock()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    def wait_trickles(self, count: int, timeout_s: float = 15.0) -> None:
        """Until ``count`` slow answers have begun (AssertionError after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while self.trickles < count:
            assert time.monotonic() < deadline, f"{self.trickles} of {count} trickles began"
            time.sleep(0.05)

    def begin_trickle(self) -> None:
        with self._lock:
            self.trickles += 1

    def stop(self) -> None:
        self.stopped.set()
        self.shutdown()
        self.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Origin

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        origin, path = self.server, urlsplit(self.path).path
        if path in (TRICKLE_BODY, TRICKLE_HEADERS):
            origin.begin_trickle()
            if path == TRICKLE_BODY:
                self.send_response(200)
                self.send_header("Content-Type", "video/mp4")
                self.send_header("Content-Length", str(1 << 20))
                self.end_headers()
            else:
                self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            end = time.monotonic() + origin.trickle_s
            try:
                while time.monotonic() < end and not origin.stopped.wait(origin.interval_s):
                    self.wfile.write(b"a")
            except OSError:  # the client went away
                pass
            self.close_connection = True
            return
        data = origin.files.get(path)
        if data is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "video/mp4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def serving_origin(files: dict[str, bytes] | None = None, **kwargs: float) -> Iterator[Origin]:
    """A started :class:`Origin`, stopped (its slow answers ended) on exit."""
    origin = Origin(files or {}, **kwargs)
    threading.Thread(target=origin.serve_forever, daemon=True).start()
    try:
        yield origin
    finally:
        origin.stop()
