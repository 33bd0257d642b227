"""Standing questions on live streams against the real server (one start, 2 CPU ranks, the
trained tiny model, pushed 56x56 frames): asked "Is there a flash?" (yes / no), an event within
one chunk of a flash (server-sent events and the webhook), none on flash-free frames, the
minimum hold of a threshold rule, the colour question's answer on the flash's chunk,
coalescing under load, a watch on a closed stream, bad watches refused (a webhook to a
disallowed host among them); on a stream with temporal pruning, a push that keeps no patch
adds no tokens (held on the server: no job on the ranks, its patches still counted) and a
watch reuses its last answer, its hold still counting."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("ray")
pytest.importorskip("fastapi")

from apbv.synthetic.needles import COLOURS, FRAME_SIZE, PRESENCE_ANSWERS, QUESTIONS  # noqa: E402
from tests.serve.hooks import webhook_receiver  # noqa: E402
from tests.serve.server import call, refused, serving  # noqa: E402

NEEDLE_TINY = Path(__file__).resolve().parents[3] / "apbv" / "assets" / "needle-tiny"
KEY = "watch-key"
QUESTION = QUESTIONS["retrieval"]  # "What colour is the flash?"
CHOICES = list(COLOURS)
PRESENCE = QUESTIONS["presence"]  # "Is there a flash?"
PRESENCE_CHOICES = list(PRESENCE_ANSWERS)  # yes, no
OPEN = {"fps": 2.0, "width": FRAME_SIZE, "height": FRAME_SIZE, "min_pixels": 3136,
        "max_pixels": 3136}
WAIT_S = 60.0




@pytest.fixture(scope="module")
def hooks():
    """A webhook receiver on 127.0.0.1 (the server allows that host, by IP)."""
    with webhook_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def base():
    with serving(NEEDLE_TINY, "--world-size", "2", "--api-key", KEY, "--allow-webhook-host",
                 "127.0.0.1", "--set", "parallel.timeout_s=60") as srv:
        srv.wait_ready()
        yield srv.base


def _call(method: str, url: str, **kwargs) -> httpx.Response:
    return call(method, url, KEY, 60, **kwargs)


def _png(pixels: torch.Tensor) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels.permute(1, 2, 0).numpy()).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _chunk(seed: int, flash: str | None = None) -> list[str]:
    """4 frames (2 s at 2 fps, 2 temporal patches): noise, or noise then a ``flash``."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (3, FRAME_SIZE, FRAME_SIZE), generator=g, dtype=torch.uint8)
    second = noise if flash is None else \
        torch.tensor(COLOURS[flash], dtype=torch.uint8).view(3, 1, 1).expand_as(noise)
    return [_png(noise), _png(noise), _png(second), _png(second)]


def _open(base: str) -> str:
    opened = _call("POST", base + "/v1/streams", json=OPEN)
    assert opened.status_code == 201, opened.text
    return f"{base}/v1/streams/{opened.json()['id']}"


def _push(url: str, frames: list[str]) -> float:
    pushed = _call("POST", url + "/frames", json={"frames": frames})
    assert pushed.status_code == 200, pushed.text
    return _call("GET", url).json()["last_timestamp"]


def _watch(url: str, question: str = PRESENCE, choices: list[str] = PRESENCE_CHOICES,
           **body) -> dict:
    made = _call("POST", url + "/watches", json={"question": question, "choices": choices,
                                                 **body})
    assert made.status_code == 201, made.text
    return made.json()


def _settled(url: str, ts: float) -> dict[str, dict]:
    """The stream's watches once every one evaluated the frame at ``ts`` (bounded wait)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        watches = {w["id"]: w for w in _call("GET", url + "/watches").json()["data"]}
        if all(w["last_timestamp"] == ts for w in watches.values()):
            return watches
        assert time.monotonic() < deadline, f"not evaluated at {ts} s: {watches}"
        time.sleep(0.1)


class _Events:
    """The server-sent events of ``url`` read by a thread until ``count`` came."""

    def __init__(self, url: str, count: int):
        self.events: list[dict] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, args=(url, count), daemon=True).start()
        assert self.ready.wait(10), "the event stream did not open"

    def _read(self, url: str, count: int) -> None:
        with httpx.stream("GET", url, timeout=WAIT_S,
                          headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                self.ready.set()
                if line.startswith("data: "):
                    self.events.append(json.loads(line[6:]))
                    if len(self.events) >= count:
                        return

    def wait(self, count: int) -> list[dict]:
        deadline = time.monotonic() + WAIT_S
        while len(self.events) < count:
            assert time.monotonic() < deadline, f"{len(self.events)} events: {self.events}"
            time.sleep(0.05)
        return self.events


def test_an_event_within_one_chunk_of_a_flash_none_without(base, hooks):
    flashed, plain = _open(base), _open(base)
    sid = flashed.rsplit("/", 1)[1]
    for url in (flashed, plain):
        _push(url, _chunk(1))
    change = _watch(flashed, webhook=hooks.url)
    held = _watch(flashed, rule="threshold", choice="yes", threshold=0.6, hysteresis=0.2,
                  hold=2)
    colour = _watch(flashed, QUESTION, CHOICES)  # its answer on noise wanders: no event claim
    quiet = _watch(plain)
    events = _Events(f"{base}/v1/events?stream={sid}&watch={change['id']}", 1)
    stream_events = _Events(f"{flashed}/events?watch={held['id']}", 1)
    for seed in (2, 3):
        _settled(plain, _push(plain, _chunk(seed)))
        _settled(flashed, _push(flashed, _chunk(seed)))
    assert events.events == [] and stream_events.events == []  # noise only: no event yet
    flash_ts = _push(flashed, _chunk(4, flash="red"))
    first = events.wait(1)[0]
    assert first["watch"] == change["id"] and first["stream"] == sid
    assert (first["answer"], first["previous"]) == ("yes", "no")
    assert first["footage_ts"] == flash_ts and first["probs"]["yes"] > 0.5
    assert 0 < first["capture_to_event_s"] < WAIT_S and first["ttft_s"] > 0
    stages = first["stages"]  # where the latency went: the flash's append, the evaluation
    assert stages["append_s"] > 0 and stages["eval_s"] > 0 and stages["eval_wait_s"] >= 0
    assert stages["append_s"] + stages["eval_s"] < first["capture_to_event_s"]
    # the threshold rule holds 2 evaluations: no event on the flash's chunk, one on the next
    watches = _settled(flashed, flash_ts)
    assert watches[held["id"]]["events"] == 0 and watches[held["id"]]["answer"] == "below"
    probs = watches[colour["id"]]["probs"]  # the colour question on the flash's chunk
    assert max(probs, key=probs.get) == "red" and probs["red"] > 0.5, probs
    next_ts = _push(flashed, _chunk(5))
    second = stream_events.wait(1)[0]
    assert (second["watch"], second["previous"], second["answer"], second["footage_ts"]) == \
        (held["id"], "below", "above", next_ts)
    watches = _settled(flashed, next_ts)
    assert watches[change["id"]]["events"] == 1 and watches[change["id"]]["answer"] == "yes"
    _settled(plain, _push(plain, _chunk(5)))
    quiet_now = _call("GET", plain + "/watches").json()["data"][0]
    assert quiet_now["id"] == quiet["id"] and quiet_now["events"] == 0 and \
        quiet_now["evaluations"] >= 3
    deadline = time.monotonic() + 10
    while not hooks.received and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [h["watch"] for h in hooks.received] == [change["id"]]
    assert hooks.received[0]["answer"] == "yes"
    metrics = httpx.get(base + "/metrics").text
    assert 'apbv:events_total{model_name=' in metrics
    assert "apbv:capture_to_event_seconds_count" in metrics
    for url in (flashed, plain):
        assert _call("DELETE", url).status_code == 200


def test_evaluations_coalesce_under_load(base):
    url = _open(base)
    _push(url, _chunk(1))
    for _ in range(3):
        _watch(url)
    with ThreadPoolExecutor(4) as pool:  # pushes back to back while evaluations run
        list(pool.map(lambda s: _call("POST", url + "/frames", json={"frames": _chunk(s)}),
                      range(10, 18)))
    last = _call("GET", url).json()["last_timestamp"]
    watches = _settled(url, last)  # the newest state is evaluated in the end
    stats = _call("GET", url).json()["watches"]
    assert stats["count"] == 3 and stats["coalesced"] >= 1, stats
    # fewer evaluations than one per watch per chunk (9 chunks), as many as were not folded
    assert all(w["evaluations"] < 9 for w in watches.values()), watches
    assert stats["footage_lag_s"] == 0.0 and stats["lag_s"] == 0.0
    refused(_call("DELETE", url + "/watches/watch-nonesuch"), 404, "no watch 'watch-nonesuch'")
    gone = next(iter(watches))
    assert _call("DELETE", f"{url}/watches/{gone}").json() == {"id": gone, "deleted": True}
    assert len(_call("GET", url + "/watches").json()["data"]) == 2
    assert _call("DELETE", url).status_code == 200


def test_a_watch_on_a_closed_stream_and_bad_watches_arerefused(base):
    url = _open(base)
    _push(url, _chunk(1))
    refused(_call("POST", url + "/watches", json={"question": QUESTION}), 400,
             "choices is required")
    refused(_call("POST", url + "/watches", json={"question": QUESTION, "choices": CHOICES,
                                                   "webhook": "http://alerts.example.com/x"}),
             400, "host 'alerts.example.com' is not in --allow-webhook-host (127.0.0.1)")
    refused(_call("POST", url + "/watches", json={"question": QUESTION, "choices": CHOICES,
                                                   "webhook": "file:///tmp/x"}),
             400, "webhook must be an http(s) URL")
    refused(_call("POST", url + "/watches", json={"question": QUESTION, "choices": CHOICES,
                                                   "rule": "threshold", "choice": "pink"}),
             400, "the rule's choice 'pink' is not one of the choices")
    refused(_call("POST", url + "/watches", json={"question": QUESTION, "choices": CHOICES,
                                                   "hold": 0}),
             400, "hold must be an integer in 1 .. 100")
    assert _call("GET", url + "/watches").json()["data"] == []
    _watch(url)
    assert _call("DELETE", url).status_code == 200
    refused(_call("POST", url + "/watches", json={"question": QUESTION, "choices": CHOICES}),
             404, "no open stream")
    refused(_call("GET", url + "/watches"), 404, "no open stream")
    refused(_call("GET", url + "/events"), 404, "no open stream")


def _pushed(url: str, frames: list[str]) -> tuple[dict, float]:
    """The push's answer and the stream's last timestamp after it."""
    pushed = _call("POST", url + "/frames", json={"frames": frames})
    assert pushed.status_code == 200, pushed.text
    return pushed.json(), _call("GET", url).json()["last_timestamp"]


def _stream_jobs(base: str) -> float:
    """Stream operations the replicas ran so far (``apbv:requests_total``, outcome stream)."""
    return sum(float(line.split()[-1]) for line in httpx.get(base + "/metrics").text.splitlines()
               if line.startswith('apbv:requests_total{outcome="stream"}'))


def test_a_pruned_static_stream_reuses_the_watch_answer_and_its_hold_still_counts(base):
    refused(_call("POST", base + "/v1/streams", json={**OPEN, "static_threshold": -1}), 400,
             "static_threshold must be in [0, 255] levels")
    opened = _call("POST", base + "/v1/streams", json={**OPEN, "static_threshold": 8})
    assert opened.status_code == 201, opened.text
    assert opened.json()["spec"]["static_threshold"] == 8
    url = f"{base}/v1/streams/{opened.json()['id']}"
    first, _ = _pushed(url, _chunk(1))  # one still image: its second patch is dropped
    assert first["patches_kept"] == 1 and first["tokens"] > 0, first
    held = _watch(url, rule="threshold", choice="yes", threshold=0.6, hysteresis=0.2, hold=2)
    same, ts = _pushed(url, _chunk(1))  # nothing changed: no tokens, the answer reused
    assert (same["patches_kept"], same["tokens"], same["chunk"]) == (0, 0, None), same
    watch = _settled(url, ts)[held["id"]]
    assert (watch["evaluations"], watch["reused"], watch["answer"]) == (2, 1, "below"), watch
    flash, ts = _pushed(url, _chunk(1, flash="red"))  # the still patch dropped, the flash kept
    assert flash["patches_kept"] == 1, flash
    watch = _settled(url, ts)[held["id"]]  # asked: "yes" once, the hold of 2 not yet met
    assert (watch["reused"], watch["events"], watch["answer"]) == (1, 0, "below"), watch
    assert watch["probs"]["yes"] >= 0.6, watch
    jobs = _stream_jobs(base)
    still = _call("POST", url + "/frames", json={"frames": _chunk(1, flash="red")[2:] * 2})
    assert still.status_code == 200 and still.json()["patches_kept"] == 0, still.text
    stats = _call("GET", url).json()  # the ranks' figures asked after the flash's push
    assert _stream_jobs(base) == jobs, "held, and GET answered without the ranks: no job"
    assert stats["pushes_held"] == 2, stats  # this one and the first unchanged one
    ts = stats["last_timestamp"]
    watch = _settled(url, ts)[held["id"]]  # reused, and the rule saw it: the event
    assert (watch["reused"], watch["events"], watch["answer"]) == (2, 1, "above"), watch
    engine = _call("GET", url).json()["engine"]
    assert engine["patches_pruned"] == 1 + 2 + 1 + 2, engine
    refused(_call("POST", url + "/ask", json={"question": PRESENCE, "fresh": True}), 400,
             "temporal pruning")
    reused = [line for line in httpx.get(base + "/metrics").text.splitlines()
              if line.startswith(("apbv:watch_reused_total{", "apbv:stream_pushes_held_total{"))]
    assert len(reused) == 2 and all(float(r.split()[-1]) >= 2 for r in reused), reused
    assert _call("DELETE", url).status_code == 200
