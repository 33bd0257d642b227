"""The tiny Qwen3-VL (apbv.model.qwen3_vl.adapter) against transformers' own, on 1, 2 and 3 gloo
ranks.

The reference is the stock ``Qwen3VLForConditionalGeneration`` (SDPA) with the stock processor
on the decoded video file: its own frame choice (``num_frames``, ``fps=None``), its own resize
(the clip's pixel budget; 150x220 frames become 160x224), its timestamps from the file's fps,
greedy ``generate`` and first-token logits. apbv's side is ``Engine.generate`` on the same file,
the checkpoint loaded through the family registry: the frames sampled, resized and processed
by the adapter, the vision tower on each rank's whole temporal patches, the main embeddings and
the three DeepStack levels routed together to the ranks that own the video tokens, the ZigZag
exact plan with apbv's prefill (DeepStack added after decoder layers 0-2) and distributed
greedy decode: the same tokens and first-token logits within 1e-4 (fp32) on every rank, also
from the vision cache (the rows keep their DeepStack levels) and with ``vision.pipeline``.

The video has 5 temporal patches (9 frames, the last padded) of 5 x 7 tokens: 175 video tokens
and 5 patches divide evenly by neither 2 nor 3 ranks, nor does the prompt's length. spava
answers alike on every rank (live streams: tests/multirank/test_family_stream.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from apbv.config import RuntimeConfig, load_config
from apbv.distributed import DistInfo, spawn_local
from apbv.engine.engine import Engine
from apbv.engine.request import Result
from tests.families import tiny_dir

QUESTION = "Which colour comes after the blue one?"
FILE_FRAMES = 9
"""Frames sampled from the test video (odd: the processor pads the last temporal patch)."""
NEW_TOKENS = 6
WORLD_SIZES = (1, 2, 3)
LOGIT_TOL = 1e-4  # fp32: attention split over ranks reorders sums
VIDEO_TOKENS = 5 * 5 * 7  # temporal patches x (160 / 32) x (224 / 32)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_dir(tmp_path_factory, "qwen3_vl")


@pytest.fixture(scope="module")
def video_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 s at 10 fps, 220x150 (the processor resizes it to 224x160)."""
    from apbv.synthetic.videos import write_test_video

    return write_test_video(tmp_path_factory.mktemp("video") / "qwen3.mp4", num_frames=30,
                            fps=10.0, width=220, height=150, seed=5)


@pytest.fixture(scope="module")
def reference(qwen3_dir: Path, video_file: Path) -> dict:
    """transformers alone on the decoded file: the stock processor's frame choice, resize and
    timestamps, greedy ``generate`` and the first-token logits."""
    import decord
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration
    from transformers.video_utils import VideoMetadata

    reader = decord.VideoReader(str(video_file))
    frames = torch.from_numpy(reader.get_batch(list(range(len(reader)))).asnumpy())
    processor = AutoProcessor.from_pretrained(qwen3_dir, local_files_only=True)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(
        qwen3_dir, local_files_only=True, attn_implementation="sdpa").eval()
    messages = [{"role": "user", "content": [{"type": "video"},
                                             {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    metadata = VideoMetadata(total_num_frames=len(reader), fps=reader.get_avg_fps())
    inputs = processor(text=[text], videos=[frames.permute(0, 3, 1, 2)],
                       video_metadata=[metadata], do_sample_frames=True,
                       num_frames=FILE_FRAMES, fps=None, return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        logits = hf(**inputs).logits[0, -1].float()
    ids = inputs["input_ids"][0]
    return {"length": len(ids), "logits": logits, "tokens": out[0, len(ids):].tolist(),
            "video_tokens": int((ids == hf.config.video_token_id).sum()),
            "grid": inputs["video_grid_thw"][0].tolist()}


def _engine_job(cfg: RuntimeConfig, video: str, info: DistInfo) -> dict:
    """``Engine.generate`` on the video file: exact (the whole Result), spava's tokens, exact
    again from the vision cache (the DeepStack levels kept with the rows) and exact with
    ``vision.pipeline`` (one temporal patch per tower call)."""
    engine = Engine(cfg, info)

    def ask(mode: str) -> Result:
        return engine.generate(engine.request(video, QUESTION, mode=mode,
                                              max_new_tokens=NEW_TOKENS))

    exact, spava, cached = ask("exact"), ask("spava"), ask("exact")
    engine.set_vision(dataclasses.replace(cfg.vision, pipeline=True, chunk_rows=10 * 14))
    piped = ask("exact")
    return {"exact": exact, "spava": spava.token_ids, "cached": cached,
            "piped": piped.token_ids}


def _rank_job(info: DistInfo, cfg: RuntimeConfig, video: str) -> dict:
    """World sizes 1..3 in one spawn: ranks [0, k) form world k (a subgroup)."""
    import torch.distributed as dist

    groups = {k: dist.new_group(list(range(k))) for k in WORLD_SIZES}  # every rank, up front
    out = {}
    for k in WORLD_SIZES:
        if info.rank < k:
            out[k] = _engine_job(cfg, video, dataclasses.replace(info, world_size=k,
                                                                 group=groups[k]))
    return out


@pytest.fixture(scope="module")
def per_world(qwen3_dir: Path, video_file: Path) -> dict:
    """world size -> the per-rank results of that world."""
    cfg = load_config("tiny_cpu", [f"model.path={str(qwen3_dir)!r}",
                                   f"video.nframes={FILE_FRAMES}", "cache.vision_gb=0.01"])
    per_rank = spawn_local(_rank_job, max(WORLD_SIZES), (cfg, str(video_file)),
                           timeout_s=600, collective_timeout_s=120)
    return {k: [r[k] for r in per_rank[:k]] for k in WORLD_SIZES}


def test_reference_is_the_uneven_case(reference: dict) -> None:
    """The stock processor's video and prompt divide evenly by neither 2 nor 3 ranks."""
    assert reference["grid"] == [5, 10, 14], reference["grid"]  # resized 150x220 -> 160x224
    assert reference["video_tokens"] == VIDEO_TOKENS
    for n in (reference["length"], VIDEO_TOKENS, reference["grid"][0]):
        assert n % 2 and n % 3, n
    assert len(reference["tokens"]) == NEW_TOKENS and len(set(reference["tokens"])) > 1


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_engine_exact_matches_transformers(world_size: int, per_world: dict,
                                           reference: dict) -> None:
    """Exact mode on ``world_size`` ranks: the stock processor's prompt, tokens and logits."""
    for rank, r in enumerate(per_world[world_size]):
        exact = r["exact"]
        assert exact.frames == FILE_FRAMES + 1  # padded to whole temporal patches
        assert exact.context_len + exact.query_len == reference["length"]
        err = (exact.first_logits - reference["logits"]).abs().max().item()
        assert err <= LOGIT_TOL, (f"rank {rank}/{world_size}: exact first-token logits vs "
                                  f"transformers: max err {err:.2e} > {LOGIT_TOL:g}")
        assert exact.token_ids == reference["tokens"], (rank, exact.token_ids,
                                                        reference["tokens"])
        assert r["spava"] == per_world[world_size][0]["spava"] and r["spava"]
        assert r["cached"].vision_cache_hit and r["cached"].token_ids == reference["tokens"]
        err = (r["cached"].first_logits - reference["logits"]).abs().max().item()
        assert err <= LOGIT_TOL, f"rank {rank}/{world_size}: from the vision cache: {err:.2e}"
        assert r["piped"] == reference["tokens"], "vision.pipeline"
    exact = per_world[world_size][0]["exact"]
    row = 4 * 64 * 4  # a token's embedding and its 3 DeepStack levels, 64 fp32 values each
    assert exact.allgather_bytes == (world_size - 1) * VIDEO_TOKENS * row, exact.allgather_bytes
    if world_size > 1:
        assert exact.embedding_bytes > 0 and exact.embedding_bytes % row == 0
