"""The real server (one CPU rank) with 8 downloads trickling from a local origin: a question on a
local file is answered as fast as alone, each trickling download fails at its whole-download
deadline (504), one more is a 429 naming --max-downloads, no temporary file stays; and Ctrl-C
while downloads trickle exits within 10 s, ending them with a 503 (the last test: it stops the
module's server)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray")
pytest.importorskip("fastapi")

from tests.serve.origin import TRICKLE_BODY, TRICKLE_HEADERS, serving_origin  # noqa: E402
from tests.serve.server import serving  # noqa: E402

DEADLINE_S = 6.0
"""--download-timeout-s of the server."""
SLOW = 8
"""Trickling downloads at once (the server's --max-downloads)."""


@pytest.fixture(scope="module")
def origin():
    with serving_origin(interval_s=0.5, trickle_s=90) as origin:
        yield origin


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, short_video: Path, tmp_path_factory: pytest.TempPathFactory):
    """(the server process, its media root, the directory holding its download directory)."""
    media = tmp_path_factory.mktemp("media")
    shutil.copy(short_video, media / "clip.mp4")
    downloads = tmp_path_factory.mktemp("downloads")
    with serving(tiny_model_dir, "--world-size", "1", "--media-root", str(media),
                 "--max-frames", "16", "--allow-media-domain", "127.0.0.1",
                 "--download-timeout-s", str(DEADLINE_S), "--max-downloads", str(SLOW),
                 "--download-dir", str(downloads)) as srv:
        srv.wait_ready()
        yield srv, media, downloads
    assert list(downloads.iterdir()) == [], "the download directory was left behind"


def _body(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}},
        {"type": "text", "text": "What colour is the square?"}]}], "max_tokens": 2}


def _post(base: str, url: str, out: list | None = None) -> tuple[int, str, float]:
    """(status, the error body or '', seconds) of one chat request; appended to ``out``."""
    started = time.monotonic()
    try:
        response = httpx.post(base + "/v1/chat/completions", json=_body(url), timeout=60)
        status = response.status_code
        message = "" if status == 200 else response.text
    except httpx.HTTPError as exc:  # the server went away (Ctrl-C)
        status, message = 0, f"{type(exc).__name__}: {exc}"
    result = (status, message, time.monotonic() - started)
    if out is not None:
        out.append(result)
    return result


def _trickle(base: str, origin, count: int) -> tuple[list[threading.Thread], list]:
    """``count`` trickling downloads (body and headers in turn), each in a thread, begun at
    the origin when this returns."""
    results: list = []
    begun = origin.trickles
    threads = [threading.Thread(target=_post, args=(base, origin.base + path, results),
                                daemon=True)
               for path in [(TRICKLE_BODY, TRICKLE_HEADERS)[i % 2] for i in range(count)]]
    for thread in threads:
        thread.start()
    origin.wait_trickles(begun + count)
    return threads, results


def test_a_local_question_never_waits_behind_trickling_downloads(server, origin):
    srv, media, downloads = server
    local = (media / "clip.mp4").as_uri()
    assert _post(srv.base, local)[0] == 200  # warm
    status, message, alone = _post(srv.base, local)
    assert status == 200, message
    threads, results = _trickle(srv.base, origin, SLOW)
    status, message, _ = _post(srv.base, origin.base + TRICKLE_BODY)
    assert status == 429, message
    assert f"the most at once (--max-downloads {SLOW})" in message
    status, message, busy = _post(srv.base, local)
    assert status == 200, message
    assert all(t.is_alive() for t in threads), "the downloads ended before the question"
    assert busy <= alone + 2, (busy, alone)
    for thread in threads:
        thread.join(timeout=DEADLINE_S + 10)
    assert len(results) == SLOW
    for status, message, seconds in results:
        assert status == 504 and f"{DEADLINE_S:g} s (--download-timeout-s)" in message, message
        assert seconds <= DEADLINE_S + 2, seconds
    (private,) = downloads.iterdir()
    assert list(private.iterdir()) == [], "a download's temporary file was left"


def test_ctrl_c_exits_within_10_s_while_downloads_trickle(server, origin):
    """Last: stops the module's server (its fixture then finds it exited, with code 0)."""
    srv = server[0]
    threads, results = _trickle(srv.base, origin, 4)
    started = time.monotonic()
    srv.proc.send_signal(signal.SIGINT)
    try:
        srv.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail("the server did not exit within 10 s of SIGINT:\n" + srv.tail())
    assert srv.proc.returncode == 0, srv.tail()
    assert time.monotonic() - started <= 10
    for thread in threads:
        thread.join(timeout=5)
    assert len(results) == 4
    for status, message, _ in results:  # ended, not left to their deadline
        assert status == 503 and "the server is shutting down" in message, (status, message)
