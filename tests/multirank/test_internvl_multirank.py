"""The tiny InternVL3 (apbv.model.internvl.adapter) against transformers' own, on 1, 2 and 3 gloo
ranks.

The reference is the stock ``InternVLForConditionalGeneration`` (SDPA) with the stock processor
on the same frames: its ``generate`` (greedy) and its first-token logits. apbv's side: the
adapter's prompt ids and pixel values (equal to the processor's), the vision tower on each
rank's whole frames (the shares, concatenated, equal the stock image features), the ZigZag
exact plan over the ranks with apbv's prefill and distributed greedy decode (fp32 logits
within 1e-4, the same tokens), on a prompt whose length divides by neither 2 nor 3.

The engine end to end (``Engine.generate`` on a video file, the checkpoint loaded through the
family registry): the stock processor's frame choice on the decoded file (``num_frames``, its
own resize) and greedy ``generate`` are the reference; exact mode's tokens and first-token
logits equal it on 1, 2 and 3 ranks (each rank encodes whole frames, the per-frame runs of
video tokens are routed to their owners), also with ``vision.pipeline`` (a frame per chunk),
and spava answers alike on every rank (live streams and decoded frames:
tests/multirank/test_family_stream.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from apbv.config import RuntimeConfig, load_config
from apbv.distributed import DistInfo, spawn_local
from apbv.engine.answer import DecodeSettings
from apbv.engine.decode import decode_reserve
from apbv.engine.engine import Engine
from apbv.engine.prefill import prefill
from apbv.engine.request import Request
from apbv.engine.runner import finish_answer
from apbv.layout import shard
from apbv.model.internvl.adapter import InternVL, load
from apbv.modes import get_mode
from apbv.plan import patch_ranges
from apbv.timing import StageTimer
from apbv.video import VideoSpec
from tests.families import stock_internvl, stock_internvl_file, tiny_dir

QUESTION = "Which colour comes after the blue one?"
NUM_FRAMES = 3
FILE_FRAMES = 5
"""Frames the engine samples from the test video (odd: InternVL3 needs no frame pairs)."""
NEW_TOKENS = 6
WORLD_SIZES = (1, 2, 3)
LOGIT_TOL = 1e-4  # fp32: attention split over ranks reorders sums
CPU = torch.device("cpu")


def _frames() -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (NUM_FRAMES, 3, 120, 160), dtype=torch.uint8,
                         generator=generator)


@pytest.fixture(scope="module")
def internvl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_dir(tmp_path_factory, "internvl")


@pytest.fixture(scope="module")
def reference(internvl_dir: Path) -> dict:
    """transformers alone: the stock processor, model and greedy ``generate``."""
    processor, hf, text = stock_internvl(internvl_dir, QUESTION)
    inputs = processor(text=[text], videos=[_frames()], return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        logits = hf(**inputs).logits[0, -1].float()
        features = hf.model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
    ids = inputs["input_ids"][0]
    return {"ids": ids, "pixels": inputs["pixel_values"], "logits": logits,
            "tokens": out[0, len(ids):].tolist(), "features": features.reshape(-1, 96)}


@pytest.fixture(scope="module")
def video_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 s at 10 fps, 160x120 (not square: the processor's resize to 448x448 shows)."""
    from apbv.synthetic.videos import write_test_video

    return write_test_video(tmp_path_factory.mktemp("video") / "internvl.mp4", num_frames=30,
                            fps=10.0, width=160, height=120, seed=4)


@pytest.fixture(scope="module")
def file_reference(internvl_dir: Path, video_file: Path) -> dict:
    """transformers alone on the video file: every frame decoded, the stock processor's own
    frame choice (``num_frames``, ``do_sample_frames``) and resize, greedy ``generate``."""
    hf, inputs = stock_internvl_file(internvl_dir, video_file, QUESTION, FILE_FRAMES)
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        logits = hf(**inputs).logits[0, -1].float()
    ids = inputs["input_ids"][0]
    return {"length": len(ids), "logits": logits, "tokens": out[0, len(ids):].tolist()}


def _engine_job(cfg: RuntimeConfig, video: str, info: DistInfo) -> dict:
    """``Engine.generate`` on the video file: exact (tokens, first logits) and spava."""
    engine = Engine(cfg, info)
    exact = engine.generate(engine.request(video, QUESTION, mode="exact",
                                           max_new_tokens=NEW_TOKENS))
    spava = engine.generate(engine.request(video, QUESTION, mode="spava",
                                           max_new_tokens=NEW_TOKENS))
    engine.set_vision(dataclasses.replace(cfg.vision, pipeline=True, chunk_rows=32 * 32))
    piped = engine.generate(engine.request(video, QUESTION, mode="exact",
                                           max_new_tokens=NEW_TOKENS))  # a frame per chunk
    return {"exact": exact, "spava": spava.token_ids, "piped": piped.token_ids}


def _world_job(adapter: InternVL, info: DistInfo) -> dict:
    """One world size: this rank's frame share through the tower, then exact and spava."""
    context_ids, query_ids = adapter.prompt_ids(QUESTION, NUM_FRAMES)
    ids = torch.cat([context_ids, query_ids])
    pixels, grid = adapter.process_frames(_frames())
    first, end = patch_ranges(NUM_FRAMES, info.world_size)[info.rank]  # whole frames
    with torch.inference_mode():
        local = adapter.vision_tower(pixels[first:end], (end - first, *grid[1:]))
    shares: list = [local]
    if info.world_size > 1:
        shares = [None] * info.world_size
        dist.all_gather_object(shares, local, group=info.group)
    video = torch.cat(shares)
    out: dict = {"ids": ids, "pixels": pixels, "vision": local}
    for mode in ("exact", "spava"):
        plan = get_mode(mode).plan(len(context_ids), len(query_ids), info.world_size)
        positions = adapter.positions(ids, grid, 0.0)
        with torch.inference_mode():
            embeds = adapter.embed(ids.unsqueeze(0))
            embeds[ids.unsqueeze(0) == adapter.video_token_id] = video
            logits, cache = prefill(adapter, shard(embeds, plan, info.rank),
                                    shard(positions, plan, info.rank, dim=2), plan, info,
                                    reserve=decode_reserve(NEW_TOKENS, None)[0])
            tokens = finish_answer(adapter, logits, int(positions.max()) + 1, cache, info,
                                   StageTimer(CPU, info.group),
                                   Request(video=VideoSpec("frames"), question=QUESTION,
                                           mode=mode, max_new_tokens=NEW_TOKENS),
                                   DecodeSettings()).tokens
        out[mode] = {"logits": logits, "tokens": tokens}
    return out


def _rank_job(info: DistInfo, model_dir: str, cfg: RuntimeConfig, video: str) -> dict:
    """World sizes 1..3 in one spawn: ranks [0, k) form world k (a subgroup), the adapter is
    loaded once per process (and once more per world by its engine)."""
    adapter = load(model_dir, device=CPU, dtype=torch.float32)
    groups = {k: dist.new_group(list(range(k))) for k in WORLD_SIZES}  # every rank, up front
    out = {}
    for k in WORLD_SIZES:
        if info.rank < k:
            world = dataclasses.replace(info, world_size=k, group=groups[k])
            out[k] = {**_world_job(adapter, world), "engine": _engine_job(cfg, video, world)}
    return out


@pytest.fixture(scope="module")
def per_world(internvl_dir: Path, video_file: Path) -> dict:
    """world size -> the per-rank results of that world."""
    cfg = load_config("tiny_cpu", [f"model.path={str(internvl_dir)!r}",
                                   f"video.nframes={FILE_FRAMES}"])
    per_rank = spawn_local(_rank_job, max(WORLD_SIZES), (str(internvl_dir), cfg, str(video_file)),
                           timeout_s=600, collective_timeout_s=120)
    return {k: [r[k] for r in per_rank[:k]] for k in WORLD_SIZES}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_exact_matches_transformers(world_size: int, per_world: dict, reference: dict) -> None:
    length = len(reference["ids"])
    assert length % 2 and length % 3, f"pick a prompt whose length ({length}) divides by neither"
    per_rank = per_world[world_size]
    assert torch.equal(per_rank[0]["ids"], reference["ids"]), "ids differ from the processor's"
    assert torch.equal(per_rank[0]["pixels"], reference["pixels"])
    vision = torch.cat([r["vision"] for r in per_rank])
    err = (vision - reference["features"]).abs().max().item()
    assert err <= 1e-5, f"frame-parallel vision vs the stock image features: max err {err:.2e}"
    for rank, r in enumerate(per_rank):
        err = (r["exact"]["logits"] - reference["logits"]).abs().max().item()
        assert err <= LOGIT_TOL, (f"rank {rank}/{world_size}: exact first-token logits vs "
                                  f"transformers: max err {err:.2e} > {LOGIT_TOL:g}")
        assert r["exact"]["tokens"] == reference["tokens"], (rank, r["exact"]["tokens"],
                                                             reference["tokens"])
        assert r["spava"]["tokens"] == per_rank[0]["spava"]["tokens"]
    assert len(reference["tokens"]) == NEW_TOKENS and len(set(reference["tokens"])) > 1


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_engine_exact_matches_transformers(world_size: int, per_world: dict,
                                           file_reference: dict) -> None:
    """``Engine.generate`` on the file: the stock processor's frames, prompt and tokens."""
    length = file_reference["length"]
    assert length % 2 and length % 3, f"pick a prompt whose length ({length}) divides by neither"
    for rank, r in enumerate(per_world[world_size]):
        exact = r["engine"]["exact"]
        assert exact.frames == FILE_FRAMES and exact.context_len + exact.query_len == length
        err = (exact.first_logits - file_reference["logits"]).abs().max().item()
        assert err <= LOGIT_TOL, (f"rank {rank}/{world_size}: engine exact first-token logits "
                                  f"vs transformers: max err {err:.2e} > {LOGIT_TOL:g}")
        assert exact.token_ids == file_reference["tokens"], (rank, exact.token_ids,
                                                             file_reference["tokens"])
        assert r["engine"]["piped"] == file_reference["tokens"], "vision.pipeline"
        assert r["engine"]["spava"] == per_world[world_size][0]["engine"]["spava"]
        assert len(r["engine"]["spava"]) >= 1
    if world_size > 1:
        assert per_world[world_size][0]["engine"]["exact"].embedding_bytes > 0
    assert len(set(file_reference["tokens"])) > 1


def test_chunked_tower_and_frame_chunks_match(internvl_dir: Path, reference: dict) -> None:
    """One frame per tower call (``vision.chunk_rows`` = one frame's 1024 patch rows) and
    frames handed over in chunks give the stock image features."""
    adapter = load(internvl_dir, device=CPU, dtype=torch.float32)
    adapter.chunk_rows = 32 * 32
    frames = _frames()
    with torch.inference_mode():
        chunked = adapter.vision_tower(*adapter.tower_rows(frames))
        pieces = adapter.encode_frames([frames[:2], frames[2:]])
    for got in (chunked, pieces):
        err = (got - reference["features"]).abs().max().item()
        assert err <= 1e-5, f"max err {err:.2e}"


def test_cost_prompt_geometry_is_the_engines(internvl_dir: Path) -> None:
    """The cost model's video_start and context length of a video prompt, as the engine
    builds the prompt."""
    from transformers import AutoProcessor

    from apbv import cost
    from apbv.cost.internvl import INTERNVL_VIDEO_START
    from apbv.model.internvl.prompt import internvl_prompt_ids

    dims = cost.checkpoint_dims(internvl_dir)
    assert dims.video_start == INTERNVL_VIDEO_START == cost.preset_dims("internvl3-8b").video_start
    processor = AutoProcessor.from_pretrained(internvl_dir, local_files_only=True)
    for frames in (1, 4, 9):
        context, _ = internvl_prompt_ids(processor, "What happens?", frames)
        assert cost.video_context_len(dims, frames, (16, 16)) == len(context), frames
    video = context.tolist().index(processor.tokenizer.context_image_token_id)
    assert video == dims.video_start
