"""Live streams over HTTP on the real server (2 CPU rank actors, the tiny model): pushed PNG
frames answer like one-shot exact on the same pixels, choices, stats, the memory budget and
DELETE, and bodies refused before any rank sees them."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("ray")
pytest.importorskip("fastapi")

from apbv.distributed import spawn_local  # noqa: E402
from tests.serve.server import serving  # noqa: E402

QUESTION = "What moves in the video?"
CHOICES = ["a red square", "nothing", "blue"]
SIZE = 112
# One stream reserves (window 64 + one push of 8 frames: 64 tokens) x 512 KV bytes per token
# on each rank: 64 KiB. The budget holds one such stream, not two.
BUDGET_GB = str(96 * 1024 / 1024**3)
OPEN = {"fps": 2.0, "max_pixels": SIZE * SIZE, "window_tokens": 64}


def _frames() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    frames = torch.randint(0, 256, (10, 3, SIZE // 4, SIZE // 4), generator=g, dtype=torch.uint8)
    return frames.repeat_interleave(4, dim=2).repeat_interleave(4, dim=3)  # small PNGs


def _png(frame: torch.Tensor) -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(frame.permute(1, 2, 0).numpy()).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def _reference(info, model_dir: str, frames: torch.Tensor):
    from apbv.config import load_config
    from apbv.engine.engine import Engine
    from apbv.engine.request import Request
    from apbv.video import DecodedVideo

    engine = Engine(load_config("tiny_cpu", [f"model.path={model_dir!r}"]), info)
    video = DecodedVideo(frames, 2.0)
    answer = engine.generate(Request(video=video, question=QUESTION, mode="exact",
                                     max_new_tokens=5))
    table = engine.generate(Request(video=video, question=QUESTION, mode="exact",
                                    choices=tuple(CHOICES)))
    return answer.token_ids, table.choices


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path):
    """(base URL, the one-shot reference computed while the server starts)."""
    with serving(tiny_model_dir, "--world-size", "2", "--max-frames-per-push", "8",
                 "--stream-memory-gb", BUDGET_GB, "--set", "parallel.timeout_s=20") as srv:
        ranks = spawn_local(_reference, 2, (str(tiny_model_dir), _frames()), timeout_s=120)
        srv.wait_ready()
        yield srv.base, ranks[0]


def _open(base: str, **body) -> httpx.Response:
    return httpx.post(base + "/v1/streams", json={**OPEN, **body}, timeout=60)


def _refused(response: httpx.Response, status: int, text: str) -> None:
    assert response.status_code == status, response.text
    assert text in response.json()["error"]["message"], response.text


def test_pushed_frames_answer_like_one_shot(server):
    base, (token_ids, table) = server
    opened = _open(base)  # no width/height: the first push fixes the frame size
    assert opened.status_code == 201, opened.text
    sid = opened.json()["id"]
    frames = _frames()
    for lo, hi in ((0, 3), (3, 7), (7, 10)):  # odd pushes: a frame waits for its pair
        pushed = httpx.post(f"{base}/v1/streams/{sid}/frames", timeout=60,
                            json={"frames": [_png(f) for f in frames[lo:hi]]})
        assert pushed.status_code == 200, pushed.text
        assert pushed.json()["frames_pushed"] == hi
    asked = httpx.post(f"{base}/v1/streams/{sid}/ask", timeout=60,
                       json={"question": QUESTION, "max_tokens": 5})
    assert asked.status_code == 200, asked.text
    out = asked.json()
    assert out["object"] == "chat.completion" and out["apbv"]["stream"] == sid
    assert out["apbv"]["token_ids"] == token_ids
    assert out["usage"]["completion_tokens"] == len(token_ids) and out["apbv"]["ttft_s"] > 0
    scored = httpx.post(f"{base}/v1/streams/{sid}/ask", timeout=60,
                        json={"question": QUESTION, "choices": CHOICES}).json()
    got = scored["apbv"]["choices"]
    assert [c["text"] for c in got] == CHOICES
    assert [c["logprob"] for c in got] == pytest.approx([c["logprob"] for c in table],
                                                        abs=1e-4)
    assert scored["choices"][0]["message"]["content"] == max(got, key=lambda c: c["prob"])["text"]
    stats = httpx.get(f"{base}/v1/streams/{sid}", timeout=60).json()
    assert stats["frames_pushed"] == 10 and stats["pushes"] == 3 and stats["asks"] == 2
    assert stats["spec"]["height"] == stats["spec"]["width"] == SIZE
    assert stats["native_size"] == {"height": SIZE, "width": SIZE}
    engine = stats["engine"]
    assert engine["frames_held"] == 10 and engine["chunks_evicted"] == 0
    assert sum(engine["video_tokens_per_rank"]) == 5 * 16
    assert all(t > 0 for t in engine["tokens_per_rank"]) and engine["seconds_held"] == 5.0
    assert httpx.delete(f"{base}/v1/streams/{sid}", timeout=60).json()["closed"] is True
    _refused(httpx.get(f"{base}/v1/streams/{sid}"), 404, "no open stream")


def test_memory_budget_and_delete(server):
    base = server[0]
    first = _open(base, width=SIZE, height=SIZE)
    assert first.status_code == 201, first.text
    assert first.json()["reserved_gb_per_rank"] == 64 * 1024 / 1024**3
    _refused(_open(base, width=SIZE, height=SIZE), 507,
             "the stream would reserve 0.0001 GiB of KV per rank, and the 1 open stream(s)")
    _refused(_open(base), 507, "per-rank stream budget (--stream-memory-gb): lower "
                               "window_tokens or window_s")
    sid = first.json()["id"]
    assert httpx.delete(f"{base}/v1/streams/{sid}", timeout=60).status_code == 200
    second = _open(base, width=SIZE, height=SIZE)  # fits now
    assert second.status_code == 201, second.text
    httpx.delete(f"{base}/v1/streams/{second.json()['id']}", timeout=60)
    _refused(_open(base, window_tokens=None), 507, "would reserve 0.0305 GiB")  # no window


def test_bad_bodies_are_refused(server):
    base = server[0]
    sid = _open(base, width=SIZE, height=SIZE).json()["id"]
    url = f"{base}/v1/streams/{sid}"
    frame = _png(_frames()[0])
    small = _png(_frames()[0, :, :56, :56])
    cases = [
        ({"frames": [frame, small]}, 400, "frames[1] is 56x56, but the stream's frame size "
                                          "is 112x112"),
        ({"frames": [frame] * 9}, 400,
         "the number of frames in one push is 9, over the limit of 8 (--max-frames-per-push)"),
        ({"frames": ["not base64!"]}, 400, "frames[0] is not valid base64"),
        ({"frames": [frame, frame], "timestamps": [1.0, 0.5]}, 400,
         "timestamps must increase: 0.5 follows 1.0"),
        ({"frames": [frame], "colour": 1}, 400, "the body must be a JSON object"),
    ]
    for body, status, text in cases:
        _refused(httpx.post(url + "/frames", json=body, timeout=60), status, text)
    _refused(httpx.post(url + "/ask", json={"question": "?", "max_tokens": 5000}), 400,
             "5000, over the limit of 1024 (--max-tokens)")
    _refused(httpx.post(url + "/ask", json={"question": "What?"}, timeout=60), 400,
             "the stream holds no frames yet")
    _refused(httpx.post(base + "/v1/streams", json={"fps": 2, "width": 112}), 400,
             "width and height go together")
    _refused(httpx.post(base + "/v1/streams", json={"source": "file:///etc/passwd"}), 403,
             "no --media-root is configured")
    stats = httpx.get(url, timeout=60).json()
    assert stats["frames_pushed"] == 0 and "engine" in stats
    httpx.delete(url, timeout=60)
