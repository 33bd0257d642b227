"""Temporal pruning (``video.static_threshold``) on 2 gloo ranks against transformers' own
single-process forward of the same pruned prompt, for each family.

The video: 6 temporal patches of a fixed scene with sensor noise (+-3 levels); a white
square appears in patch 2 and stays through patch 4, a corner turns black in patch 5. At 8
levels patches 0, 2 and 5 are kept: patch 3, rank 1's first, is judged against patch 2 on rank
0 (the last kept one) and dropped. A second video never changes: only its first patch is kept,
rank 1 keeps nothing, and the answer still comes.

The reference per family, on the kept frames only: Qwen2.5-VL, the stock model with apbv's
pruned ids and M-RoPE positions (the kept tokens at their own times); Qwen3-VL, the stock
processor and model on the kept frames with their own frame indices (so the ``<t seconds>``
texts are those of the kept patches; its ids equal apbv's); InternVL3, the stock model on
apbv's ids (each kept frame keeps its ``FrameN:``) and the stock pixel values. Exact mode's
first-token logits are within 1e-4 (fp32) of it on both ranks, the tokens are the
reference's greedy ones; for Qwen2.5-VL the exact baseline zigzag_ring matches too, and every
other mode (spava, no_overlap, no_vit_split, star, apb) answers alike on both ranks over the
same pruned prompt (``full`` is the one-rank baseline: not run on 2 ranks). A video of random
frames keeps every patch with pruning on: its prompt, first-token logits and tokens are bit
for bit those of pruning off.

Per-token pruning (``video.pruning_rate``), alone and after the threshold: the mask is the
pure rule's on the whole video's signatures (computed here in one process); the reference
is transformers' own tower on the kept patches, whole, its rows of the pruned tokens dropped
(DeepStack's with them), and the stock model's forward over the prompt of those patches less
the pruned placeholders, at that prompt's positions less theirs (Qwen3-VL's from the stock
processor and ``get_rope_index``, InternVL3's 0..T-1). Exact mode equals it on both ranks as
above; spava answers alike on both ranks.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from apbv.config import load_config
from apbv.distributed import DistInfo, spawn_local
from apbv.engine.engine import Engine
from apbv.engine.request import Request
from apbv.modes import MODE_NAMES
from apbv.video import DecodedVideo
from apbv.video.prune import keep_mask, prune_tokens, signatures, token_mask
from tests.families import tiny_dir

QUESTION = "What changed in the scene?"
THRESHOLD = 8.0
NEW_TOKENS = 4
LOGIT_TOL = 1e-4  # fp32: attention split over ranks reorders sums
PATCHES = 6
KEPT = [0, 2, 5]
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "internvl")
UNIT = {"qwen2_5_vl": 2, "qwen3_vl": 2, "internvl": 1}
SIDE = {"qwen2_5_vl": 28, "qwen3_vl": 32, "internvl": 28}
EXACT_MODES = ("exact", "zigzag_ring")
RATED = ((0.0, 0.5), (THRESHOLD, 0.5))
"""(static_threshold, pruning_rate) of the per-token runs: the rate alone, and after the
threshold's patches."""
STOCK_VISION = ["vision.attention=per_window", "vision.patch_embed=conv",
                "vision.preprocess=processor"]
"""Qwen2.5-VL's stock vision path: the fused one differs from transformers' by up to 4e-4 in
these logits (|logits| ~19) with or without pruning; the stock one by 6e-6."""


def camera(family: str, *, changes: bool) -> DecodedVideo:
    """A fixed 2x3-cell scene, ``PATCHES`` temporal patches of the family's unit, noise of
    +-3 levels on every frame; with ``changes`` the square and the corner above."""
    side, unit = SIDE[family], UNIT[family]
    generator = torch.Generator().manual_seed(7)
    scene = torch.randint(40, 200, (3, 2 * side, 3 * side), generator=generator)
    frames = []
    for i in range(PATCHES * unit):
        frame = scene + torch.randint(-3, 4, scene.shape, generator=generator)
        patch = i // unit
        if changes and 2 <= patch <= 4:
            frame[:, :side // 2, :side // 2] = 255
        if changes and patch == 5:
            frame[:, side:, 2 * side:] = 0
        frames.append(frame.clamp(0, 255).to(torch.uint8))
    return DecodedVideo(torch.stack(frames), 2.0, image_patch_size=side // 2)


def busy_video(family: str) -> DecodedVideo:
    """Every frame a random colour per cell (side x side): every temporal patch changes
    everywhere by far more than the threshold (random pixels would not: a cell's mean of
    random pixels hardly moves)."""
    side, unit = SIDE[family], UNIT[family]
    cells = torch.randint(0, 256, (PATCHES * unit, 3, 2, 3), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(8))
    frames = cells.repeat_interleave(side, dim=2).repeat_interleave(side, dim=3)
    return DecodedVideo(frames, 2.0, image_patch_size=side // 2)


def _rank_job(info: DistInfo, dirs: dict[str, str]) -> dict:
    out: dict[str, Any] = {}
    for family, path in dirs.items():
        engine = Engine(load_config("tiny_cpu", [f"model.path={path!r}"] + (
            STOCK_VISION if family == "qwen2_5_vl" else [])), info)
        modes = [m for m in MODE_NAMES if m != "full"] if family == "qwen2_5_vl" \
            else ["exact", "spava"]  # full: the one-rank baseline
        answers = {}
        for changes in (True, False):
            for mode in modes if changes else ("exact",):
                answers[changes, mode] = engine.generate(Request(
                    video=camera(family, changes=changes), question=QUESTION, mode=mode,
                    max_new_tokens=NEW_TOKENS, static_threshold=THRESHOLD))
        rated = {}
        for threshold, rate in RATED:
            for mode in ("exact", "spava"):
                rated[threshold, mode] = engine.generate(Request(
                    video=camera(family, changes=True), question=QUESTION, mode=mode,
                    max_new_tokens=NEW_TOKENS, static_threshold=threshold, pruning_rate=rate))
        busy = busy_video(family)  # every patch changes: pruning on keeps them all
        for threshold in (THRESHOLD, 0.0):
            answers["busy", threshold] = engine.generate(Request(
                video=busy, question=QUESTION, mode="exact", max_new_tokens=NEW_TOKENS,
                static_threshold=threshold))
        out[family] = {k: (r.first_logits, r.token_ids, r.context_len)
                       for k, r in answers.items()}
        out[family, "rate"] = {k: (r.first_logits, r.token_ids, r.context_len)
                               for k, r in rated.items()}
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, str]:
    return {"qwen2_5_vl": str(tiny_model_dir),
            "qwen3_vl": str(tiny_dir(tmp_path_factory, "qwen3_vl")),
            "internvl": str(tiny_dir(tmp_path_factory, "internvl"))}


@pytest.fixture(scope="module")
def per_rank(dirs: dict[str, str]) -> list[dict]:
    return spawn_local(_rank_job, 2, (dirs,), timeout_s=600, collective_timeout_s=120)


def _stock_classes() -> dict[str, Any]:
    from transformers import (
        InternVLForConditionalGeneration,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
    )

    return {"qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
            "qwen3_vl": Qwen3VLForConditionalGeneration,
            "internvl": InternVLForConditionalGeneration}


@functools.cache
def _loaded(family: str, path: str) -> tuple[Any, Any]:
    """apbv's adapter (prompt, positions, pixel values) and the stock model (SDPA)."""
    from apbv.model.families import load_adapter

    adapter = load_adapter(path, device=torch.device("cpu"), dtype=torch.float32)
    return adapter, _stock_classes()[family].from_pretrained(
        path, local_files_only=True, attn_implementation="sdpa").eval()


def _stock(family: str, path: str, video: DecodedVideo, kept: list[int]) -> dict:
    """transformers' single-process forward and greedy tokens on the kept frames."""
    adapter, hf = _loaded(family, path)
    unit = UNIT[family]
    frames = video.frames.view(PATCHES, unit, *video.frames.shape[1:])[kept].flatten(0, 1)
    sampling = video.sampling
    grid = adapter.video_grid(sampling)
    context, query = adapter.prompt(QUESTION, grid, sampling=sampling, kept=kept)
    ids = torch.cat([context, query])
    if family == "qwen3_vl":
        from transformers.video_utils import VideoMetadata

        messages = [{"role": "user", "content": [{"type": "video"},
                                                 {"type": "text", "text": QUESTION}]}]
        text = adapter.processor.apply_chat_template(messages, add_generation_prompt=True)
        indices = [unit * g + f for g in kept for f in range(unit)]
        inputs = dict(adapter.processor(
            text=[text], videos=[frames], video_metadata=[VideoMetadata(
                total_num_frames=len(video.frames), fps=video.fps, frames_indices=indices)],
            do_sample_frames=False, do_resize=False, return_tensors="pt"))
        assert inputs["input_ids"][0].tolist() == ids.tolist(), "ids differ from the processor's"
    else:
        pixels, _ = adapter.process_frames(frames)
        inputs = {"input_ids": ids.unsqueeze(0)}
        if family == "internvl":
            inputs["pixel_values"] = pixels
        else:
            inputs.update(pixel_values_videos=pixels,
                          video_grid_thw=torch.tensor([[len(kept), *grid[1:]]]),
                          position_ids=adapter.positions(ids, grid, sampling.second_per_grid_t,
                                                         kept))
    with torch.inference_mode():
        logits = hf(**inputs).logits[0, -1].float()
        if family == "qwen2_5_vl":  # explicit positions: greedy by hand
            tokens, seq, pos = [], ids, inputs["position_ids"]
            for _ in range(NEW_TOKENS):
                step = hf(input_ids=seq.unsqueeze(0), pixel_values_videos=inputs[
                    "pixel_values_videos"], video_grid_thw=inputs["video_grid_thw"],
                    position_ids=pos).logits[0, -1]
                tokens.append(int(step.argmax()))
                seq = torch.cat([seq, torch.tensor(tokens[-1:])])
                pos = torch.cat([pos, torch.full((3, 1, 1), int(pos.max()) + 1)], dim=2)
        else:
            out = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
            tokens = out[0, inputs["input_ids"].shape[1]:].tolist()
    return {"logits": logits, "tokens": tokens, "context_len": len(context)}


@pytest.mark.parametrize("family", FAMILIES)
def test_pruned_prompt_equals_transformers_on_the_kept_patches(
        family: str, dirs: dict[str, str], per_rank: list[dict]) -> None:
    for changes, kept in ((True, KEPT), (False, [0])):
        video = camera(family, changes=changes)
        cells = (16, 16) if family == "internvl" else (2, 3)  # InternVL3: 448 / 28
        sigs = signatures(video.frames, UNIT[family], cells)
        mask = keep_mask(sigs, THRESHOLD)
        assert [i for i, k in enumerate(mask) if k] == kept, (family, changes, mask)
        want = _stock(family, dirs[family], video, kept)
        assert len(want["tokens"]) == NEW_TOKENS and len(set(want["tokens"])) > 1, want
        modes = [m for (c, m) in per_rank[0][family] if c is changes]
        for rank, results in enumerate(per_rank):
            for mode in modes:
                logits, tokens, context_len = results[family][changes, mode]
                what = f"{family} rank {rank} {mode} changes={changes}"
                assert context_len == want["context_len"], (what, context_len, want)
                assert len(tokens) == NEW_TOKENS, (what, tokens)
                if mode not in EXACT_MODES:
                    assert tokens == per_rank[0][family][changes, mode][1], what
                    continue
                err = (logits.float() - want["logits"]).abs().max().item()
                assert err <= LOGIT_TOL, (f"{what}: first-token logits vs transformers on the "
                                          f"kept patches: max err {err:.2e} > {LOGIT_TOL:g}")
                assert tokens == want["tokens"], (what, tokens, want["tokens"])


@pytest.mark.parametrize("family", FAMILIES)
def test_pruning_that_keeps_everything_is_bit_identical_to_off(
        family: str, per_rank: list[dict]) -> None:
    for rank, results in enumerate(per_rank):
        on, off = results[family]["busy", THRESHOLD], results[family]["busy", 0.0]
        assert on[2] == off[2], (family, rank, on[2], off[2])
        assert torch.equal(on[0], off[0]), (
            f"{family} rank {rank}: logits with every patch kept differ from pruning off by "
            f"{(on[0] - off[0]).abs().max().item():.2e}")
        assert on[1] == off[1], (family, rank)


def _masks(family: str, video: DecodedVideo, threshold: float, rate: float,
           ) -> tuple[list[int], torch.Tensor]:
    """(the kept patches, (K, S) their kept tokens) by the pure rule on the whole video."""
    cells = (16, 16) if family == "internvl" else (2, 3)  # InternVL3: 448 / 28
    sigs = signatures(video.frames, UNIT[family], cells)
    keep = keep_mask(sigs, threshold) if threshold else [True] * len(sigs)
    patches, tokens = prune_tokens(keep, token_mask(sigs, keep, rate))
    return [i for i, k in enumerate(patches) if k], tokens


def _stock_rated(family: str, path: str, video: DecodedVideo, kept: list[int],
                 tokens: torch.Tensor) -> dict:
    """transformers' forward and greedy tokens over the kept patches with only ``tokens``."""
    adapter, hf = _loaded(family, path)
    unit = UNIT[family]
    frames = video.frames.view(PATCHES, unit, *video.frames.shape[1:])[kept].flatten(0, 1)
    sampling, rows = video.sampling, tokens.flatten()
    grid = adapter.video_grid(sampling)
    context, query = adapter.prompt(QUESTION, grid, sampling=sampling, kept=kept)
    whole = torch.cat([context, query])
    is_video = whole == adapter.video_token_id
    assert int(is_video.sum()) == len(rows), (int(is_video.sum()), tokens.shape)
    stay = torch.ones(len(whole), dtype=torch.bool)
    stay[is_video] = rows
    ids = whole[stay]
    with torch.inference_mode():
        if family == "internvl":
            pixels, _ = adapter.process_frames(frames)
            feats = hf.model.get_image_features(
                pixels, vision_feature_layer=hf.config.vision_feature_layer,
                vision_feature_select_strategy=hf.config.vision_feature_select_strategy)
            feats = getattr(feats, "pooler_output", feats).flatten(0, 1)[rows]
            positions = torch.arange(len(whole))[stay]

            embeds = hf.get_input_embeddings()(ids.unsqueeze(0))
            embeds[0, is_video[stay]] = feats.to(embeds.dtype)
            prompt: dict[str, Any] = {"inputs_embeds": embeds,
                                      "position_ids": positions.unsqueeze(0)}
        else:
            if family == "qwen3_vl":
                from transformers.video_utils import VideoMetadata

                messages = [{"role": "user", "content": [{"type": "video"},
                                                         {"type": "text", "text": QUESTION}]}]
                text = adapter.processor.apply_chat_template(messages, add_generation_prompt=True)
                indices = [unit * g + f for g in kept for f in range(unit)]
                inputs = adapter.processor(
                    text=[text], videos=[frames], video_metadata=[VideoMetadata(
                        total_num_frames=len(video.frames), fps=video.fps,
                        frames_indices=indices)],
                    do_sample_frames=False, do_resize=False, return_tensors="pt")
                assert inputs["input_ids"][0].tolist() == whole.tolist(), "not the stock ids"
                pixels, thw = inputs["pixel_values_videos"], inputs["video_grid_thw"]
                full, _ = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                  video_grid_thw=thw)
            else:
                pixels, _ = adapter.process_frames(frames)
                thw = torch.tensor([[len(kept), *grid[1:]]])
                full = adapter.positions(whole, grid, sampling.second_per_grid_t, kept)
            positions = full[..., stay][:, 0]
            out = hf.model.get_video_features(pixels, thw, return_dict=True)
            fields: dict[str, Any] = {"pooler_output": (torch.cat(out.pooler_output)[rows],)}
            if getattr(out, "deepstack_features", None) is not None:  # Qwen3-VL's DeepStack
                fields["deepstack_features"] = [(torch.cat(f)[rows],)
                                                for f in out.deepstack_features]
            encoded = type(out)(**fields)

            positions = positions.unsqueeze(1)
            prompt = {"input_ids": ids.unsqueeze(0), "position_ids": positions,
                      "mm_encoder_outputs": {"video": encoded}}
        out = hf(**prompt, use_cache=True)
        logits = out.logits[0, -1].float()
        out_tokens = [int(logits.argmax())]
        at = int(positions.max()) + 1  # greedy by hand, positions on from the largest
        while len(out_tokens) < NEW_TOKENS:
            out = hf(input_ids=torch.tensor([out_tokens[-1:]]), cache=out.cache, use_cache=True,
                     position_ids=torch.full((*positions.shape[:-1], 1), at))
            out_tokens.append(int(out.logits[0, -1].argmax()))
            at += 1
    return {"logits": logits, "tokens": out_tokens, "context_len": len(ids) - len(query)}


@pytest.mark.parametrize("family", FAMILIES)
def test_token_pruned_prompt_equals_transformers_on_the_kept_tokens(
        family: str, dirs: dict[str, str], per_rank: list[dict]) -> None:
    video = camera(family, changes=True)
    for threshold, rate in RATED:
        kept, tokens = _masks(family, video, threshold, rate)
        assert kept[0] == 0 and bool(tokens[0].all()), (family, kept, tokens[0])
        assert not bool(tokens.all()), f"{family}: the rate dropped no token"
        want = _stock_rated(family, dirs[family], video, kept, tokens)
        assert len(set(want["tokens"])) > 1, want
        for rank, results in enumerate(per_rank):
            what = f"{family} rank {rank} threshold={threshold} rate={rate}"
            logits, got, context_len = results[family, "rate"][threshold, "exact"]
            assert context_len == want["context_len"], (what, context_len, want["context_len"])
            err = (logits.float() - want["logits"]).abs().max().item()
            assert err <= LOGIT_TOL, (f"{what}: first-token logits vs transformers on the kept "
                                      f"tokens: max err {err:.2e} > {LOGIT_TOL:g}")
            assert got == want["tokens"], (what, got, want["tokens"])
            spava = results[family, "rate"][threshold, "spava"]
            assert spava[2] == context_len and len(spava[1]) == NEW_TOKENS, (what, spava)
            assert spava[1] == per_rank[0][family, "rate"][threshold, "spava"][1], what
