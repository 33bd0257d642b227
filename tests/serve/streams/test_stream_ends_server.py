"""The real server (one start, 1 CPU rank, the tiny model, live streams of 56x56 frames) when
streams end and ranks die: a DELETE ends the stream's event streams with ``stream.closed``
(reason ``closed``, also to its watch's webhook and to ``/v1/events``); then (last: it costs a
rebuild) SIGKILL of the idle replica's rank: ``/health`` leaves ``ready`` within a few seconds
without any request, the stream's subscribers get ``stream.closed`` (reason ``lost``) and its
routes answer 410, and the group is rebuilt."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray")
pytest.importorskip("fastapi")

from tests.serve.hooks import webhook_receiver  # noqa: E402
from tests.serve.server import serving  # noqa: E402
from tests.serve.test_server import _metric  # noqa: E402

KEY = "ends-key"
OPEN = {"fps": 2.0, "width": 56, "height": 56, "max_pixels": 56 * 56, "window_tokens": 64}
WATCH = {"question": "Is there a flash?", "choices": ["yes", "no"]}
LEAVES_READY_S = 5.0
"""/health must leave ``ready`` this soon after a rank is SIGKILLed (the idle ping is every
2 s, and waits up to 5 s for a stopped rank; a dead one fails at once)."""




@pytest.fixture(scope="module")
def hooks():
    with webhook_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def base(tiny_model_dir: Path):
    with serving(tiny_model_dir, "--world-size", "1", "--api-key", KEY,
                 "--allow-media-domain", "127.0.0.1", "--allow-webhook-host", "127.0.0.1",
                 "--set", "parallel.timeout_s=20") as srv:
        srv.wait_ready()
        yield srv.base


def _call(method: str, url: str, **kwargs) -> httpx.Response:
    return httpx.request(method, url, timeout=30, headers={"Authorization": f"Bearer {KEY}"},
                         **kwargs)


def _open(base: str) -> str:
    opened = _call("POST", base + "/v1/streams", json=OPEN)
    assert opened.status_code == 201, opened.text
    return f"{base}/v1/streams/{opened.json()['id']}"


class _Events:
    """An event stream read by a thread: its (event name, data) pairs, and whether the server
    ended it."""

    def __init__(self, url: str):
        self.events: list[tuple[str, dict]] = []
        self.ended = False
        self.open = threading.Event()
        threading.Thread(target=self._read, args=(url,), daemon=True).start()
        assert self.open.wait(10), "the event stream did not open"

    def _read(self, url: str) -> None:
        name = "message"
        with httpx.stream("GET", url, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                self.open.set()
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    self.events.append((name, json.loads(line[6:])))
        self.ended = True

    def closed(self, stream_id: str, timeout_s: float = 10) -> dict:
        """The ``stream.closed`` event of ``stream_id`` (waited for)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [d for n, d in self.events if n == "stream.closed" and
                     d["stream"] == stream_id]
            if found:
                return found[0]
            assert time.monotonic() < deadline, self.events
            time.sleep(0.02)

    def wait_end(self, timeout_s: float = 5) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ended:
            assert time.monotonic() < deadline, ("the event stream did not end", self.events)
            time.sleep(0.02)


def test_delete_ends_the_event_streams_with_stream_closed(base, hooks):
    url = _open(base)
    sid = url.rsplit("/", 1)[1]
    made = _call("POST", url + "/watches", json={**WATCH, "webhook": hooks.url})
    assert made.status_code == 201, made.text
    watch = made.json()["id"]
    on_stream, on_watch, every = (_Events(url + "/events"),
                                  _Events(f"{base}/v1/events?watch={watch}"),
                                  _Events(base + "/v1/events"))
    assert _call("DELETE", url).json() == {"id": sid, "closed": True}
    sent = time.monotonic()
    for events in (on_stream, on_watch):
        events.wait_end()
        assert [n for n, _ in events.events] == ["stream.closed"], events.events
    ended_s = time.monotonic() - sent
    event = on_stream.events[0][1]
    assert (event["object"], event["stream"], event["reason"], event["watches"]) == \
        ("stream.closed", sid, "closed", [watch]), event
    assert on_watch.events[0][1] == event and every.closed(sid) == event
    assert not every.ended  # an unfiltered subscriber goes on
    deadline = time.monotonic() + 10
    while not [e for e in hooks.received if e.get("object") == "stream.closed"]:
        assert time.monotonic() < deadline, hooks.received
        time.sleep(0.05)
    assert [e for e in hooks.received if e.get("object") == "stream.closed"] == [event]
    gone = _call("GET", url)
    assert gone.status_code == 404, gone.text
    assert gone.json()["error"]["message"] == f"no open stream {sid!r}: it was closed by its " \
                                              "client", gone.text
    print(f"event streams ended {ended_s:.3f} s after the DELETE")


def test_a_sigkilled_idle_rank_is_lost_without_a_request_and_its_stream_is_410(base):
    url = _open(base)
    sid = url.rsplit("/", 1)[1]
    on_stream, every = _Events(url + "/events"), _Events(base + "/v1/events")
    health = _call("GET", base + "/health").json()
    assert health["status"] == "ready", health
    pid = health["rank_pids"][0]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while True:  # no request but /health
        health = _call("GET", base + "/health")
        if health.json()["status"] != "ready":
            break
        assert time.monotonic() - killed < LEAVES_READY_S, health.json()
        time.sleep(0.05)
    left_s = time.monotonic() - killed
    assert health.status_code == 503 and health.json()["status"] == "degraded", health.json()
    event = on_stream.closed(sid)
    on_stream.wait_end()
    lost_s = time.monotonic() - killed
    assert event["reason"] == "lost" and every.closed(sid) == event, event
    assert event["message"].startswith(f"stream {sid!r} was lost: replica 0's ranks were "
                                       "lost ("), event
    for method, route, body in [("GET", "", None), ("POST", "/frames", {"frames": []}),
                                ("POST", "/ask", {"question": "What is shown?"}),
                                ("GET", "/watches", None), ("GET", "/events", None),
                                ("DELETE", "", None)]:
        answer = _call(method, url + route, json=body)
        assert answer.status_code == 410, (method, route, answer.text)
        assert answer.json()["error"]["message"] == event["message"], answer.text
    deadline = time.monotonic() + 120
    while True:
        health = _call("GET", base + "/health").json()
        if health["status"] == "ready":
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.25)
    assert pid not in health["rank_pids"] and "lost" not in health["replicas"][0], health
    assert _metric(base, "apbv:group_rebuilds_total") == 1
    print(f"/health left ready {left_s:.3f} s after SIGKILL; the stream's subscribers had "
          f"stream.closed (lost) after {lost_s:.3f} s; rebuilt after "
          f"{time.monotonic() - killed:.1f} s")
