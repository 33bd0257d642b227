"""Live streams on the real server (one start, a 2 s --stream-idle-s): a stream whose client
waits on a long ask is not closed under it as idle; a source that is no video is a 400 at
open, at once; a timestamp out of bounds is refused with the bound named and leaves the
stream usable."""

from __future__ import annotations

import base64
import io
import time
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("ray")
pytest.importorskip("fastapi")

from tests.serve.server import call, refused, serving  # noqa: E402

KEY = "robust-key"
IDLE_S = 2.0
SIZE = 56


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "notes.mp4").write_text("these are notes, not a video\n" * 100)
    return root


@pytest.fixture(scope="module")
def base(tiny_model_dir: Path, media: Path):
    with serving(tiny_model_dir, "--world-size", "2", "--media-root", str(media), "--api-key",
                 KEY, "--stream-idle-s", str(IDLE_S), "--stream-end-after-s", "30",
                 "--set", "parallel.timeout_s=60") as srv:
        srv.wait_ready()
        yield srv.base


def _call(method: str, url: str, **kwargs) -> httpx.Response:
    return call(method, url, KEY, 120, **kwargs)


def _pngs(count: int, seed: int) -> list[str]:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        pixels = torch.randint(0, 256, (SIZE, SIZE, 3), generator=g, dtype=torch.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels.numpy()).save(buffer, format="PNG")
        out.append(base64.b64encode(buffer.getvalue()).decode())
    return out


def test_a_source_that_is_no_video_is_refused_at_open(base, media):
    start = time.monotonic()
    refused(_call("POST", base + "/v1/streams", json={"source": f"file://{media}/notes.mp4"}),
             400, f"source: followed video '{media}/notes.mp4' is not a video that can be "
                  "followed")
    assert time.monotonic() - start < 10  # not after --stream-end-after-s (30 s)


def test_a_stream_in_use_is_not_closed_as_idle(base):
    opened = _call("POST", base + "/v1/streams",
                   json={"fps": 2.0, "width": SIZE, "height": SIZE, "window_tokens": 64})
    assert opened.status_code == 201, opened.text
    url = f"{base}/v1/streams/{opened.json()['id']}"
    pushed = _call("POST", url + "/frames",
                   json={"frames": _pngs(4, 1), "timestamps": [0.0, 0.5, 1.0, 1.5]})
    assert pushed.status_code == 200, pushed.text
    refused(_call("POST", url + "/frames", json={"frames": _pngs(1, 2), "timestamps": [1e308]}),
             400, "timestamps must be within +-1e+10 s, got 1e+308")
    refused(_call("POST", url + "/frames", json={"frames": _pngs(1, 2),
                                                  "timestamps": [4000.0]}),
             400, "timestamps may jump at most 3600 s from the previous frame: 4000.0 follows "
                  "1.5")
    start = time.monotonic()
    asked = _call("POST", url + "/ask", json={"question": "Describe every frame in detail.",
                                              "max_tokens": 1000})
    took = time.monotonic() - start
    assert asked.status_code == 200, asked.text
    # The check means something only if the ask outlasted the idle limit and a sweep after it.
    assert took > 2 * IDLE_S, f"the ask took {took:.1f} s, too short to show anything"
    pushed = _call("POST", url + "/frames", json={"frames": _pngs(2, 3)})  # 2.0 s, 2.5 s
    assert pushed.status_code == 200, pushed.text
    assert pushed.json()["frames_pushed"] == 6
    stats = _call("GET", url).json()
    assert stats["asks"] == 1 and stats["last_timestamp"] == 2.5 and stats["error"] is None
    assert _call("DELETE", url).status_code == 200
