"""The real server on the tiny Qwen3-VL (2 CPU rank actors), driven with the official openai
client: ``/v1/models`` names the family, and a chat completion about a video file (exact
mode, the default 2 fps) gives the tokens of transformers' own greedy ``generate`` on the
frames, sizes and timestamps the stock processor gives; a live stream over HTTP (frames sized
to multiples of 32, pushed in two pushes) answers as ``generate`` on the same frames."""

from __future__ import annotations

import base64
import io
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
    from apbv.model.families import write_tiny_family

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


def _png(frame: torch.Tensor) -> str:
    """uint8 (3, H, W) -> base64 PNG (lossless)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(frame.permute(1, 2, 0).numpy()).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _generate_frames(qwen3_dir: Path, frames: torch.Tensor, fps: float) -> list[int]:
    """transformers alone on these frames (uint8 (F, 3, H, W), taken at ``fps``, not resized):
    greedy ``generate``'s tokens."""
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration
    from transformers.video_utils import VideoMetadata

    processor = AutoProcessor.from_pretrained(qwen3_dir, local_files_only=True)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(qwen3_dir, local_files_only=True).eval()
    messages = [{"role": "user", "content": [{"type": "video"},
                                             {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    metadata = VideoMetadata(total_num_frames=len(frames), fps=fps,
                             frames_indices=list(range(len(frames))))
    inputs = processor(text=[text], videos=[frames], video_metadata=[metadata],
                       do_sample_frames=False, do_resize=False, return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_a_live_stream_over_http_answers_as_transformers_on_its_frames(server, qwen3_dir):
    """Native 48x64 frames with max_pixels 56 x 56 are resized to 32x64 (multiples of Qwen3-VL's
    32, where Qwen2.5-VL's rule gave 56x56, which its engine refuses); two pushes of 2 frames
    at 2 fps, then an ask over the held KV."""
    base, _ = server
    headers = {"Authorization": f"Bearer {KEY}"}
    opened = httpx.post(base + "/v1/streams", headers=headers, timeout=30,
                        json={"width": 64, "height": 48, "max_pixels": 56 * 56})
    assert opened.status_code == 201, opened.text
    spec = opened.json()["spec"]
    assert (spec["height"], spec["width"]) == (32, 64), spec
    url = base + "/v1/streams/" + opened.json()["id"]
    native = torch.randint(0, 256, (4, 3, 48, 64), generator=torch.Generator().manual_seed(3),
                           dtype=torch.uint8)
    for first in (0, 2):
        pushed = httpx.post(url + "/frames", headers=headers, timeout=60,
                            json={"frames": [_png(f) for f in native[first:first + 2]]})
        assert pushed.status_code == 200, pushed.text
    asked = httpx.post(url + "/ask", headers=headers, timeout=120,
                       json={"question": QUESTION, "max_tokens": NEW_TOKENS})
    assert asked.status_code == 200, asked.text
    apbv = asked.json()["apbv"]
    assert apbv["mode"] == "exact", apbv
    from apbv.openai.frames import resize_to

    frames = resize_to(native, (32, 64))  # the server's resize of the pushed frames
    assert apbv["token_ids"] == _generate_frames(qwen3_dir, frames, FPS), apbv
    closed = httpx.delete(url, headers=headers, timeout=30)
    assert closed.status_code == 200, closed.text
