"""The real server on the tiny Qwen3-VL (2 CPU rank actors), driven with the official openai
client: ``/v1/models`` names the family, and a chat completion about a video file (exact
mode, the default 2 fps) gives the tokens of transformers' own greedy ``generate`` on the
frames, sizes and timestamps the stock processor gives."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("ray")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from tests.serve.server import serving  # noqa: E402

KEY = "qwen3-vl-key"
QUESTION = "Which colour comes after the blue one?"
NEW_TOKENS = 4
FPS = 2.0
"""Frames sampled per second (the tiny_cpu preset's video.fps and the processor's default)."""


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``make-tiny-model --family qwen3_vl``, laid out as the released checkpoint."""
    from apbv.model.tiny_families import write_tiny_family

    out = write_tiny_family("qwen3_vl", tmp_path_factory.mktemp("model") / "tiny-qwen3-vl")
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "chat_template.json", "preprocessor_config.json",
            "video_preprocessor_config.json"} == {p.name for p in out.iterdir()}
    return out


@pytest.fixture(scope="module")
def server(qwen3_dir: Path, short_video: Path, tmp_path_factory: pytest.TempPathFactory):
    media = tmp_path_factory.mktemp("qwen3-media")
    shutil.copy(short_video, media / "clip.mp4")
    with serving(qwen3_dir, "--world-size", "2", "--media-root", str(media), "--api-key",
                 KEY, "--set", "parallel.timeout_s=20", "--set", "attention.mode=exact") as srv:
        srv.wait_ready()
        yield srv.base, media


def _generate(qwen3_dir: Path, video: Path) -> tuple[list[int], int]:
    """transformers alone: every frame decoded, the stock processor's frame choice at
    :data:`FPS`, resize and timestamps, greedy ``generate``; (tokens, frames sampled)."""
    import decord
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration
    from transformers.video_utils import VideoMetadata

    reader = decord.VideoReader(str(video))
    frames = torch.from_numpy(reader.get_batch(list(range(len(reader)))).asnumpy())
    processor = AutoProcessor.from_pretrained(qwen3_dir, local_files_only=True)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(qwen3_dir, local_files_only=True).eval()
    messages = [{"role": "user", "content": [{"type": "video"},
                                             {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    metadata = VideoMetadata(total_num_frames=len(reader), fps=reader.get_avg_fps())
    inputs = processor(text=[text], videos=[frames.permute(0, 3, 1, 2)], return_tensors="pt",
                       video_metadata=[metadata], do_sample_frames=True, fps=FPS)
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    frames_sampled = int(inputs["video_grid_thw"][0, 0]) * 2
    return out[0, inputs["input_ids"].shape[1]:].tolist(), frames_sampled


def test_models_names_the_family_and_answers_match_transformers(server, qwen3_dir: Path):
    base, media = server
    models = httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"},
                       timeout=10).json()
    assert models["data"][0]["family"] == "Qwen3-VL", models
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": (media / "clip.mp4").as_uri()}},
        {"type": "text", "text": QUESTION}]}]
    out = client.chat.completions.create(model=models["data"][0]["id"], messages=messages,
                                         max_tokens=NEW_TOKENS)
    apbv = out.model_extra["apbv"]
    tokens, frames = _generate(qwen3_dir, media / "clip.mp4")
    assert apbv["frames"] == frames == 12 and apbv["mode"] == "exact", apbv
    assert apbv["token_ids"] == tokens, apbv
