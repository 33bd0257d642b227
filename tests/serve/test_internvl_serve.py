"""The real server on the tiny InternVL3 (2 CPU rank actors), driven with the official openai
client: ``/v1/models`` names the family, and a chat completion about a video file (exact
mode) gives the tokens of transformers' own greedy ``generate`` on the frames the stock
processor samples."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("ray")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from tests.families import stock_internvl_file, tiny_dir  # noqa: E402
from tests.serve.server import serving  # noqa: E402

KEY = "internvl-key"
QUESTION = "Which colour comes after the blue one?"
FRAMES = 5
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def internvl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_dir(tmp_path_factory, "internvl")


@pytest.fixture(scope="module")
def server(internvl_dir: Path, short_video: Path, tmp_path_factory: pytest.TempPathFactory):
    media = tmp_path_factory.mktemp("internvl-media")
    shutil.copy(short_video, media / "clip.mp4")
    with serving(internvl_dir, "--world-size", "2", "--media-root", str(media), "--api-key",
                 KEY, "--set", "parallel.timeout_s=20", "--set", "attention.mode=exact") as srv:
        srv.wait_ready()
        yield srv.base, media


def _generate(internvl_dir: Path, video: Path) -> list[int]:
    """transformers alone: every frame decoded, the stock processor's frame choice and resize,
    greedy ``generate``."""
    hf, inputs = stock_internvl_file(internvl_dir, video, QUESTION, FRAMES)
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_models_names_the_family_and_answers_match_transformers(server, internvl_dir: Path):
    base, media = server
    models = httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"},
                       timeout=10).json()
    assert models["data"][0]["family"] == "InternVL3", models
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": (media / "clip.mp4").as_uri()}},
        {"type": "text", "text": QUESTION}]}]
    out = client.chat.completions.create(model=models["data"][0]["id"], messages=messages,
                                         max_tokens=NEW_TOKENS, extra_body={"nframes": FRAMES})
    apbv = out.model_extra["apbv"]
    assert apbv["frames"] == FRAMES and apbv["mode"] == "exact", apbv
    assert apbv["token_ids"] == _generate(internvl_dir, media / "clip.mp4"), apbv
    assert out.usage.prompt_tokens > FRAMES * 256
