"""The real server (2 CPU rank actors, the tiny model, a short collective timeout) with long
answers running: a 3000 ms deadline behind two 1024-token answers is refused (at admission or
at dequeue), never answered late; a rank stopped mid-answer (SIGSTOP) makes ``/health`` report
the replica ``stalled``, naming the rank, within 3x the job's prediction (or 30 s), and the
answer then fails naming the rank that did not answer; the group is rebuilt."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from tests.serve.server import serving  # noqa: E402
from tests.serve.test_server import KEY, _client, _messages, _metric  # noqa: E402

MODEL = "tiny-qwen2.5-vl"
COLLECTIVE_TIMEOUT_S = 30
"""parallel.timeout_s: a stopped rank's collective fails after this long (the stall must be
visible before: within max(3x the prediction, 30 s) of the job's start, 2x or 10 s plus a
5 s ping in practice)."""


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, short_video: Path, tmp_path_factory: pytest.TempPathFactory):
    media = tmp_path_factory.mktemp("media")
    (media / "clip.mp4").write_bytes(short_video.read_bytes())
    with serving(tiny_model_dir, "--world-size", "2", "--media-root", str(media), "--api-key",
                 KEY, "--max-frames", "16", "--set",
                 f"parallel.timeout_s={COLLECTIVE_TIMEOUT_S}") as srv:
        srv.wait_ready()
        yield srv.base, (media / "clip.mp4").as_uri()


def _decoding(client: openai.OpenAI, url: str, max_tokens: int):
    """A streamed answer of up to ``max_tokens``, once its first content has arrived (its
    job is running and decoding)."""
    stream = client.chat.completions.create(model=MODEL, messages=_messages(url),
                                            max_tokens=max_tokens, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            return stream
    pytest.fail("the answer ended before its first content")


def _idle(base: str, timeout_s: float = 60) -> dict:
    """/health once nothing runs or waits."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = httpx.get(base + "/health").json()
        if health["status"] == "ready" and health["queued"] == 0 and \
                not health["replicas"][0]["running"]:
            return health
        assert time.monotonic() < deadline, health
        time.sleep(0.25)


def test_a_deadline_behind_two_long_answers_is_refused_never_answered_late(server):
    base, url = server
    client = _client(base)
    client.chat.completions.create(model=MODEL, messages=_messages(url), max_tokens=6)
    first = _decoding(client, url, 1024)
    second = client.chat.completions.create(model=MODEL, messages=_messages(url),
                                            max_tokens=1024, stream=True)  # queued behind
    body = {"model": MODEL, "messages": _messages(url), "max_tokens": 16,
            "deadline_ms": 3000}
    sent = time.monotonic()
    try:
        answer = httpx.post(base + "/v1/chat/completions", json=body, timeout=120,
                            headers={"Authorization": f"Bearer {KEY}"})
        took = time.monotonic() - sent
        assert answer.status_code in (503, 504), (answer.status_code, took, answer.text[:300])
        message = answer.json()["error"]["message"]
        assert "the deadline of 3000 ms" in message, message
        if answer.status_code == 503:  # at admission: the running answer's decode counted
            assert "tokens of it decoding at" in message, message
        assert took < 3.0, took  # refused at once, not after the long answers
    finally:
        first.close()
        second.close()
    _idle(base)
    assert _metric(base, "apbv:decode_token_seconds", '{replica="0"}') > 0


def test_a_stopped_rank_is_reported_stalled_then_named_in_the_failure(server):
    base, url = server
    client = _client(base)
    pids = _idle(base)["rank_pids"]
    stream = _decoding(client, url, 400)
    os.kill(pids[1], signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        while True:
            response = httpx.get(base + "/health")
            health = response.json()
            replica = health["replicas"][0]
            if replica["status"] == "stalled":
                break
            assert replica["running"], ("the answer ended", health)
            bound = max(3 * replica.get("predicted_s", 0), 30)
            assert replica.get("running_s", 0) <= bound, ("not reported stalled", health)
            assert time.monotonic() - stopped <= bound, ("not reported stalled", health)
            time.sleep(0.25)
        assert response.status_code == 503 and health["status"] == "stalled", health
        assert replica["stalled_ranks"] == [1], health
        assert replica["running_s"] <= max(3 * replica["predicted_s"], 30), health
        assert _metric(base, "apbv:replica_stalled", '{replica="0"}') == 1
        with pytest.raises(openai.APIError, match=r"rank\(s\) 1 of the engine group were lost "
                                                  r"\(rank 1 did not answer within 5 s\)"):
            for _ in stream:
                pass
        assert time.monotonic() - stopped < COLLECTIVE_TIMEOUT_S + 20
    finally:
        try:  # the rebuild killed it; should it have not, the server's stop must not hang
            os.kill(pids[1], signal.SIGKILL)
        except ProcessLookupError:
            pass
    health = _idle(base, timeout_s=120)
    assert pids[1] not in health["rank_pids"] and "stalled_ranks" not in health["replicas"][0]
    assert _metric(base, "apbv:replica_stalled", '{replica="0"}') == 0
    assert _metric(base, "apbv:group_rebuilds_total") == 1
