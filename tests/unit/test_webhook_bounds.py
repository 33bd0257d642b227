"""A webhook POST is bounded (:mod:`apbv.serve.watches.webhook`), tested on the sender itself with a
local receiver thread: a receiver trickling its answer is cut at the deadline, one answering
100 MB costs the server no memory (its peak RSS measured around the POST), hosts come from
their own allow list and resolve to internal addresses only when listed by IP; one client
holds a bounded number of event streams."""

from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

httpx = pytest.importorskip("httpx")

from apbv.openai.policy import ClientError  # noqa: E402
from apbv.serve.watches.events import MAX_SUBSCRIBERS_PER_CLIENT, EventHub  # noqa: E402
from apbv.serve.watches.webhook import READ_BYTES, check_addresses, post_event, webhook_url  # noqa: E402

HUGE_MB = 100
LOCAL = ("127.0.0.1",)


class _Receiver(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            if self.path == "/trickle":  # the status line, then a header byte every 0.2 s
                self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                for _ in range(300):
                    self.wfile.write(b"a")
                    self.wfile.flush()
                    time.sleep(0.2)
            elif self.path == "/huge":
                chunk = b"x" * 2**20
                self.send_response(200)
                self.send_header("Content-Length", str(HUGE_MB * 2**20))
                self.end_headers()
                for _ in range(HUGE_MB):
                    self.wfile.write(chunk)
            else:
                self.send_response(204)
                self.end_headers()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the sender closed: what it should do

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def receiver():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _status_kb(name: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(name + ":"))


def _post(url: str, timeout_s: float,
          hosts: tuple[str, ...] = LOCAL) -> tuple[str | None, float, float]:
    """(post_event's outcome, seconds, the process's peak RSS growth in MB during it)."""
    async def main() -> tuple[str | None, float]:
        async with httpx.AsyncClient(timeout=timeout_s, follow_redirects=False) as client:
            started = time.monotonic()
            why = await post_event(client, url, {"stream": "s", "watch": "w"}, hosts,
                                   timeout_s)
            return why, time.monotonic() - started

    with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) starts again from now
        f.write("5")
    before = _status_kb("VmHWM")
    why, seconds = asyncio.run(main())
    return why, seconds, (_status_kb("VmHWM") - before) / 1024


def test_a_trickling_receiver_is_cut_at_the_deadline(receiver):
    why, seconds, _ = _post(receiver + "/trickle", timeout_s=1.0)
    assert why == "no complete answer within 1 s", why
    assert 0.9 < seconds < 1.5, f"the POST took {seconds:.2f} s against a 1 s deadline"


def test_a_receiver_answering_100_mb_costs_no_memory(receiver):
    why, seconds, grown_mb = _post(receiver + "/huge", timeout_s=5.0)
    assert why is None, why  # its 200 counts: the status decides, the body is not read
    assert seconds < 5.0, f"the POST took {seconds:.2f} s"
    assert grown_mb < 4, (f"the sender's peak RSS grew by {grown_mb:.1f} MB reading a "
                          f"{HUGE_MB} MB answer (at most {READ_BYTES} bytes are read)")
    assert _post(receiver + "/ok", timeout_s=5.0)[0] is None


def test_webhook_hosts_have_their_own_list(receiver):
    assert webhook_url(receiver + "/ok", LOCAL) == receiver + "/ok"
    assert webhook_url("http://[::1]:9/x", ("::1",)) == "http://[::1]:9/x"
    for url, hosts, text in (
            ("http://alerts.example.com/x", LOCAL,
             "host 'alerts.example.com' is not in --allow-webhook-host (127.0.0.1)"),
            (receiver + "/ok", (), "webhooks are off: no --allow-webhook-host"),
            ("file:///tmp/x", LOCAL, "webhook must be an http(s) URL"),
            ("http://127.0.0.1:x/", LOCAL, "bad webhook URL")):
        with pytest.raises(ClientError) as info:
            webhook_url(url, hosts)
        assert info.value.status == 400 and text in info.value.message, info.value.message
        assert info.value.param == "webhook"


def test_an_internal_address_is_refused_unless_listed_by_ip(receiver):
    port = receiver.rsplit(":", 1)[1]
    with pytest.raises(PermissionError, match="resolves to the internal address 127.0.0.1"):
        asyncio.run(check_addresses(f"http://127.0.0.1:{port}/ok", ("localhost",)))
    with pytest.raises(PermissionError, match="169.254.169.254"):
        asyncio.run(check_addresses("http://169.254.169.254/latest", ("169.254.169.253",)))
    asyncio.run(check_addresses(f"http://127.0.0.1:{port}/ok", LOCAL))
    asyncio.run(check_addresses("http://93.184.215.14/", ()))  # public: no resolution needed
    why, _, _ = _post(receiver.replace("127.0.0.1", "localhost") + "/ok", timeout_s=2.0,
                      hosts=("localhost",))
    assert why is not None and "not listed by IP" in why, why  # localhost listed by name only


def test_one_client_holds_a_bounded_number_of_event_streams():
    hub = EventHub()
    for _ in range(MAX_SUBSCRIBERS_PER_CLIENT):
        hub.subscribe(client="10.0.0.7")
    with pytest.raises(ClientError) as info:
        hub.subscribe(client="10.0.0.7")
    assert info.value.status == 429 and (
        f"this client holds {MAX_SUBSCRIBERS_PER_CLIENT} event streams" in info.value.message)
    hub.subscribe(client="10.0.0.8")  # another client is not held back
    hub.subscribe()  # nor a subscriber without an address
