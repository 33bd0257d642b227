"""The real server (python -m apbv serve, 1 CPU rank, the tiny model) with a low host memory
budget: a request whose native frames would not fit is refused (503, the figures) before it
reaches the rank and the server keeps answering smaller requests; a video of 8192x8192 frames
is a 400 naming the limit by default, from a file or a ``data:`` URL."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray")
pytest.importorskip("fastapi")

from tests.native_video import write_large_frame_video  # noqa: E402
from tests.serve.server import serving  # noqa: E402

BUDGET_GB = 0.1
"""Room for the 112x112 clip (about 31 MiB on its rank) and not for 2048x2048 frames (about
210 MiB: 34 bytes a native pixel for the frame being decoded, 8 for each of the two frames
of a decoding chunk)."""


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, short_video: Path):
    media = tmp_path_factory.mktemp("media")
    (media / "clip.mp4").write_bytes(short_video.read_bytes())
    write_large_frame_video(media / "frames2k.mp4", 2048, 2048, frames=4)
    write_large_frame_video(media / "frames8k.mp4", 8192, 8192)
    with serving(tiny_model_dir, "--world-size", "1", "--media-root", str(media),
                 "--host-memory-budget-gb", str(BUDGET_GB), "--vision-cache-gb", "0",
                 "--max-queue", "4") as srv:
        srv.wait_ready()
        srv.media = media
        yield srv


def _chat(server, url: str) -> httpx.Response:
    body = {"max_tokens": 3, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}},
        {"type": "text", "text": "What colour is the square?"}]}]}
    return httpx.post(server.base + "/v1/chat/completions", json=body, timeout=60)


def _ran(server) -> float:
    """Jobs taken from a queue so far (each one reached the rank)."""
    text = httpx.get(server.base + "/metrics").text
    match = re.search(r"^apbv:queue_wait_seconds_count ([0-9.e+]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_a_request_past_the_budget_is_refused_before_the_rank(server):
    ran = _ran(server)
    refused = _chat(server, (server.media / "frames2k.mp4").as_uri())
    assert refused.status_code == 503, refused.text[:400]
    message = refused.json()["error"]["message"]
    needed = re.search(r"it needs ([0-9.]+) GiB of host memory", message)
    assert needed and float(needed.group(1)) > BUDGET_GB, message
    for text in ("GiB are in flight", f"the budget is {BUDGET_GB:.3f} GiB "
                                      f"(--host-memory-budget-gb)"):
        assert text in message, message
    assert _ran(server) == ran  # never queued, never decoded
    for _ in range(2):  # and the server keeps answering what fits
        answer = _chat(server, (server.media / "clip.mp4").as_uri())
        assert answer.status_code == 200, answer.text[:400]
        assert answer.json()["choices"][0]["message"]["content"]
    assert _ran(server) == ran + 2


def test_8192x8192_frames_are_a_400_naming_the_limit(server):
    path = server.media / "frames8k.mp4"
    data = "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()
    ran = _ran(server)
    for url in (path.as_uri(), data):
        refused = _chat(server, url)
        assert refused.status_code == 400, refused.text[:400]
        assert ("native frame size is 8192x8192 (67108864 pixels), over the limit of 8847360 "
                "pixels (--max-native-pixels)") in refused.json()["error"]["message"]
    assert _ran(server) == ran
