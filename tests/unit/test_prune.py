"""Temporal pruning's pure rule (apbv.video.prune), its settings and what it does to positions
and prompts, per family, without a model.

- The change is noise-robust: sensor noise of +-3 levels moves no cell's mean by more than 1,
  while a 14x14 white square in one 28x28 cell moves that cell by a quarter of its contrast
  (whole-frame averaging would dilute it to a few levels), and a magenta square of the
  background's grey level (the same luma) counts too.
- The first patch is always kept, later ones are judged against the last *kept* patch (a slow
  drift is caught every few patches; a rule against the previous patch would drop it all),
  and signatures of a rank's share equal the whole video's rows (the mask does not depend
  on the number of ranks).
- Settings: a rate outside [0, 1) and a negative threshold are refused naming the setting,
  through the config and the request; a rate in (0, 1) reaches the request.
- Per-token pruning (``video.pruning_rate``): the count kept is max(a patch's tokens,
  n - floor(rate * n)) read from the rate's decimal text, the first patch stays whole, the
  most changed tokens stay (ties to the earlier), the threshold's patches come first and
  the rate judges each against the previous kept one, a patch with no kept token is dropped,
  and the mask from shares' signatures equals the whole video's for 1-3 ranks.
- The pruned prompt (:func:`apbv.engine.pruned.drop_tokens`): the whole kept patches' ids and
  positions less the pruned placeholders; the ranks' encoded token ranges follow the mask.
- Positions: the kept tokens of a pruned Qwen2.5-VL prompt carry the positions they have in
  the whole video's prompt.
- Prompts: Qwen3-VL's pruned prompt equals the stock processor's ids on the kept patches'
  frames (their own frame indices, so each keeps its ``<t seconds>``), and the whole video's
  ids without the dropped patches' stamp, markers and tokens; InternVL3's keeps each frame's
  ``FrameN:`` with its tokens (the whole prompt without the dropped frames' lines).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from apbv.config import load_config
from apbv.engine.pruned import drop_tokens
from apbv.engine.request import PromptInputs, Request
from apbv.engine.runner import encoded_tokens
from apbv.ownership import VideoSpan, embedding_routes, token_routes
from apbv.plan import make_plan
from apbv.positions import mrope_positions
from apbv.video import DecodedVideo, Sampling
from apbv.video.prune import (
    keep_mask,
    kept_split,
    prune_tokens,
    pruned_grid,
    signatures,
    token_mask,
)

QUESTION = "What happens at the end?"


def _noisy(base: torch.Tensor, amplitude: int, seed: int) -> torch.Tensor:
    noise = torch.randint(-amplitude, amplitude + 1, base.shape,
                          generator=torch.Generator().manual_seed(seed))
    return (base.int() + noise).clamp(0, 255).to(torch.uint8)


def test_change_is_noise_robust_and_local() -> None:
    base = torch.full((3, 56, 84), 100, dtype=torch.uint8)
    frames = torch.stack([_noisy(base, 3, i) for i in range(4)])
    sigs = signatures(frames, 2, (2, 3))
    assert sigs.shape == (2, 3, 2, 3)
    noise = (sigs[1] - sigs[0]).abs().max().item()
    assert noise < 1.0, f"sensor noise of +-3 levels moved a cell by {noise:.3f}"
    square = frames.clone()
    square[2:, :, 28:42, 56:70] = 255  # a quarter of one cell, in both frames of patch 1
    sigs = signatures(square, 2, (2, 3))
    change = (sigs[1] - sigs[0]).abs().max().item()
    want = (255 - 100) / 4
    assert abs(change - want) < 1.0, f"the square's change {change:.2f} vs {want:.2f}"
    whole = (square[2:].float().mean() - square[:2].float().mean()).abs().item()
    assert whole < want / 5, f"a whole-frame mean would see {whole:.2f} only"
    magenta = frames.clone()
    magenta[2:, :, 28:42, 56:70] = torch.tensor([146, 68, 146], dtype=torch.uint8).view(3, 1, 1)
    luma = torch.tensor([0.299, 0.587, 0.114]) @ torch.tensor([146.0, 68.0, 146.0])
    assert abs(luma - 100) < 0.5  # as bright as the background
    sigs = signatures(magenta, 2, (2, 3))
    change = (sigs[1] - sigs[0]).abs().max().item()
    assert abs(change - 46 / 4) < 1.0, f"the magenta square's change {change:.2f}"


def test_keep_rule_against_the_last_kept_patch() -> None:
    drift = torch.arange(10, dtype=torch.float32).view(10, 1, 1, 1).expand(10, 3, 2, 2) * 1.0
    assert keep_mask(drift, 3.0) == [True, False, False, True, False, False, True, False,
                                     False, True]
    still = torch.zeros(5, 3, 2, 2)
    assert keep_mask(still, 0.5) == [True, False, False, False, False]
    back = torch.tensor([0.0, 10.0, 0.0, 0.0]).view(4, 1, 1)
    assert keep_mask(back, 5.0) == [True, True, True, False]


def test_signatures_of_shares_equal_the_whole() -> None:
    frames = torch.randint(0, 256, (12, 3, 56, 84), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(1))
    whole = signatures(frames, 2, (2, 3))
    shares = torch.cat([signatures(frames[a:b], 2, (2, 3)) for a, b in ((0, 6), (6, 12))])
    assert torch.equal(whole, shares)


def test_kept_split_counts_kept_patches_per_rank() -> None:
    keep = [True, False, True, False, False, False, True]
    kept, ranges = kept_split(keep, [(0, 3), (3, 5), (5, 7)])
    assert kept == (0, 2, 6)
    assert ranges == ((0, 2), (2, 2), (2, 3))  # rank 1 keeps none
    assert kept_split(keep, [(0, 7), (0, 7)])[1] == ((0, 3), (0, 3))
    assert pruned_grid((7, 4, 6), kept) == (3, 4, 6) and pruned_grid((7, 4, 6), None) == (7, 4, 6)


@pytest.mark.parametrize(("setting", "match"), [
    ("video.pruning_rate=1.0", r"video\.pruning_rate must be in \[0, 1\)"),
    ("video.pruning_rate=-0.1", r"video\.pruning_rate must be in \[0, 1\)"),
    ("video.static_threshold=-1.0", r"video\.static_threshold must be in \[0, 255\]"),
    ("video.static_threshold=true", r"video\.static_threshold must be a finite number"),
])
def test_bad_settings_are_refused_by_name(setting: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_config("tiny_cpu", [setting])
    name, value = setting.split("=")
    field = name.split(".")[1]
    video = DecodedVideo(torch.zeros(2, 3, 28, 28, dtype=torch.uint8), 2.0)
    with pytest.raises(ValueError, match=match):
        Request(video=video, question=QUESTION, mode="exact",
                **{field: True if value == "true" else float(value)})


def test_settings_reach_the_request() -> None:
    cfg = load_config("tiny_cpu", ["video.static_threshold=4.5"])
    request = Request.from_config(cfg, "clip.mp4", QUESTION)
    assert request.static_threshold == 4.5 and request.pruning_rate == 0.0
    assert "static_threshold" in request.fingerprint()
    rated = Request.from_config(load_config("tiny_cpu", ["video.pruning_rate=0.5"]), "clip.mp4",
                                QUESTION)
    assert rated.pruning_rate == 0.5 and rated.fingerprint()["pruning_rate"] != \
        request.fingerprint()["pruning_rate"]
    off = Request.from_config(load_config("tiny_cpu"), "clip.mp4", QUESTION)
    assert off.static_threshold == 0.0 and off.video == request.video


def test_kept_tokens_keep_their_positions() -> None:
    """Qwen2.5-VL: 5 patches of a 2x3 merged grid, patches 0, 3, 4 kept."""
    video_id, grid, kept = 9, (5, 4, 6), [0, 3, 4]
    whole_ids = torch.tensor([1, 2] + [video_id] * 30 + [3, 4])
    pruned_ids = torch.tensor([1, 2] + [video_id] * 18 + [3, 4])
    rules: dict[str, Any] = dict(video_token_id=video_id, spatial_merge_size=2,
                                 tokens_per_second=2.0)
    whole = mrope_positions(whole_ids, [grid], [1.0], **rules)[:, 0]
    pruned = mrope_positions(pruned_ids, [grid], [1.0], kept=[kept], **rules)[:, 0]
    rows = torch.cat([torch.arange(2 + 6 * g, 8 + 6 * g) for g in kept])
    assert torch.equal(pruned[:, 2:20], whole[:, rows])
    assert pruned[0, 2:20].unique().tolist() == [2, 8, 10]  # times 0, 3 and 4 patches in
    assert pruned[:, 20].tolist() == [int(pruned[:, :20].max()) + 1] * 3
    assert torch.equal(mrope_positions(pruned_ids, [pruned_grid(grid, kept)], [1.0], **rules),
                       mrope_positions(pruned_ids, [(3, 4, 6)], [1.0], **rules))


@pytest.fixture(scope="module")
def qwen3_processor(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from apbv.model.qwen3_vl.tiny import tiny_processor

    return tiny_processor(tmp_path_factory.mktemp("qwen3-processor"))


def _without(ids: list[int], pieces: list[list[int]]) -> list[int]:
    """``ids`` with the first occurrence of each piece (in order) removed."""
    out, at = [], 0
    for piece in pieces:
        i = next(j for j in range(at, len(ids)) if ids[j:j + len(piece)] == piece)
        out += ids[at:i]
        at = i + len(piece)
    return out + ids[at:]


def test_qwen3_vl_pruned_prompt_is_the_stock_prompt_of_the_kept_patches(
        qwen3_processor: Any) -> None:
    from transformers.video_utils import VideoMetadata

    from apbv.model.qwen3_vl.prompt import Qwen3VLRules, patch_ids

    fps, indices, kept = 3.0, list(range(0, 16, 2)), [0, 2, 3]  # 4 patches at 0.3 .. 4.3 s
    sampling = Sampling(tuple(indices), 1.5, 64, 96, 16, video_fps=fps, processor_resize=True)
    rules = Qwen3VLRules(qwen3_processor)
    grid = rules.video_grid(sampling)
    context, query = rules.prompt(QUESTION, grid, sampling=sampling, kept=kept)
    got = torch.cat([context, query]).tolist()
    frames = torch.randint(0, 256, (2 * len(kept), 3, 64, 96), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    messages = [{"role": "user", "content": [{"type": "video"},
                                             {"type": "text", "text": QUESTION}]}]
    text = qwen3_processor.apply_chat_template(messages, add_generation_prompt=True)
    kept_indices = [indices[2 * g + f] for g in kept for f in (0, 1)]
    stock = qwen3_processor(text=[text], videos=[frames], video_metadata=[VideoMetadata(
        total_num_frames=16, fps=fps, frames_indices=kept_indices)], do_sample_frames=False,
        return_tensors="pt")["input_ids"][0].tolist()
    assert got == stock
    whole = torch.cat(rules.prompt(QUESTION, grid, sampling=sampling)).tolist()
    dropped = patch_ids(qwen3_processor, 6, [1.7])  # patch 1: frames 2 and 4 at 3 fps
    assert got == _without(whole, [dropped[0][0] + dropped[0][1]])
    assert "<1.7 seconds>" not in qwen3_processor.tokenizer.decode(got)


def test_internvl_frames_keep_their_numbers(tmp_path_factory: pytest.TempPathFactory) -> None:
    from apbv.model.internvl.prompt import internvl_prompt_ids
    from apbv.model.internvl.tiny import _processor

    processor = _processor(tmp_path_factory.mktemp("internvl"))
    context, _ = internvl_prompt_ids(processor, QUESTION, 5, kept=[0, 3])
    text = processor.tokenizer.decode(context)
    assert "Frame1:" in text and "Frame4:" in text
    assert not any(f"Frame{n}:" in text for n in (2, 3, 5))
    whole, _ = internvl_prompt_ids(processor, QUESTION, 5)
    tokens = processor.image_seq_length
    line = processor.tokenizer("\nFrame2: <img><IMG_CONTEXT></img>",
                               add_special_tokens=False)["input_ids"]
    assert (context == processor.tokenizer.context_image_token_id).sum() == 2 * tokens
    assert len(whole) - len(context) == 3 * (len(line) - 1 + tokens)


def _kept_count(rate: float, n: int, per_patch: int) -> int:
    return max(per_patch, n - int(round(rate * n * 1e6)) // 10**6)


@pytest.mark.parametrize("rate", [0.0, 0.25, 0.29, 0.5, 0.75, 0.9, 0.99])
def test_token_mask_count_and_first_patch(rate: float) -> None:
    sigs = torch.rand(10, 3, 2, 5, generator=torch.Generator().manual_seed(3)) * 255
    mask = token_mask(sigs, [True] * 10, rate)
    assert mask.shape == (10, 10) and mask[0].all(), mask[0]
    assert int(mask.sum()) == _kept_count(rate, 100, 10), (rate, int(mask.sum()))
    if rate == 0.29:
        assert int(mask.sum()) == 71  # 0.29 * 100 is 28.999... in binary floats


def test_token_mask_keeps_the_most_changed_tokens() -> None:
    sigs = torch.zeros(4, 3, 2, 3)
    sigs[1:, 0, 1, 2] = 50.0  # from patch 1 on, token 5 is red: changed in patch 1 only
    sigs[2:, 2, 0, 1] = 20.0  # from patch 2 on, token 1 is blue
    sigs[3, 1, 0, 0] = 5.0    # patch 3, token 0
    mask = token_mask(sigs, [True] * 4, 1 - 9 / 24)  # 9 kept: patch 0 and 3 more
    want = torch.zeros(4, 6, dtype=torch.bool)
    want[0] = True
    want[1, 5] = want[2, 1] = want[3, 0] = True
    assert torch.equal(mask, want), mask.int()
    tie = token_mask(sigs, [True] * 4, 1 - 11 / 24)  # 2 more among the unchanged: earliest
    assert tie[1, :2].all() and int(tie[1:].sum()) == 5, tie.int()


def test_rate_after_threshold_and_empty_patches_drop() -> None:
    sigs = torch.zeros(5, 3, 1, 4)
    sigs[2:, 0, 0, 0] = 30.0  # from patch 2 on, token 0 is brighter: patch 2 passes T
    sigs[4, 0, 0, 3] = 12.0   # patch 4 token 3: below T=20, so patch 4 is not kept whole
    keep = keep_mask(sigs, 20.0)
    assert keep == [True, False, True, False, False]
    mask = token_mask(sigs, keep, 1 - 5 / 8)  # 2 patches in play, 5 of 8 tokens stay
    assert mask.tolist() == [[True] * 4, [True, False, False, False]]
    patches, rows = prune_tokens(keep, token_mask(sigs, keep, 0.5))
    assert patches == [True, False, False, False, False] and rows.tolist() == [[True] * 4]
    everything = token_mask(sigs, [True] * 5, 0.0)
    assert everything.all()


def test_token_mask_is_the_same_for_any_rank_count() -> None:
    frames = torch.randint(0, 256, (12, 3, 56, 84), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(5))
    masks = []
    for splits in (((0, 12),), ((0, 6), (6, 12)), ((0, 4), (4, 8), (8, 12))):
        sigs = torch.cat([signatures(frames[a:b], 2, (2, 3)) for a, b in splits])
        masks.append(token_mask(sigs, [True] * 6, 0.6))
    assert all(torch.equal(masks[0], m) for m in masks[1:])
    assert int(masks[0].sum()) == 36 - 21


def test_dropped_tokens_leave_the_whole_prompts_ids_and_positions() -> None:
    """Qwen2.5-VL: 2 kept patches of a 2x3 merged grid, whole, then 4 tokens pruned."""
    video_id, grid, kept = 9, (5, 4, 6), [0, 3]
    context = torch.tensor([1, 2] + [video_id] * 12 + [3])
    query = torch.tensor([4, 5])
    rules: dict[str, Any] = dict(video_token_id=video_id, spatial_merge_size=2,
                                 tokens_per_second=2.0)
    whole = mrope_positions(torch.cat([context, query]), [grid], [1.0], kept=[kept], **rules)
    tokens = torch.tensor([[True] * 6, [False, True, False, True, False, False]])
    model: Any = type("Ids", (), {"video_token_id": video_id})()
    ids, positions = drop_tokens(model, context, whole, tokens)
    assert ids.tolist() == [1, 2] + [video_id] * 8 + [3]
    stay = [0, 1] + [2 + i for i in range(6)] + [8 + 1, 8 + 3] + [14, 15, 16]
    assert torch.equal(positions, whole[..., stay])
    assert positions[0, 0, 8:10].tolist() == [8, 8]  # patch 3 at its own time
    assert positions[:, 0, 10].tolist() == [9] * 3  # the text after: as after the whole patch


def test_encoded_token_ranges_follow_the_mask() -> None:
    tokens = torch.tensor([[1, 1, 1], [0, 1, 0], [1, 0, 1], [0, 0, 1]], dtype=torch.bool)
    inputs = PromptInputs(context_ids=torch.zeros(1), query_ids=torch.zeros(1),
                          video_grid=(4, 2, 6), second_per_grid_t=1.0,
                          patch_ranges=((0, 2), (2, 4)), pixel_values=None, num_frames=8,
                          kept_tokens=tokens)
    assert encoded_tokens(inputs, 3) == [(0, 4), (4, 7)]
    whole = PromptInputs(**{**inputs.__dict__, "kept_tokens": None})
    assert encoded_tokens(whole, 3) == [(0, 6), (6, 12)]
    plan = make_plan(context_len=40, query_len=4, world_size=2, anchor_len=4, passing_len=4)
    span = VideoSpan.contiguous(5, 12, 3)
    assert token_routes(plan, span, encoded_tokens(whole, 3)) == \
        embedding_routes(plan, span, [(0, 2), (2, 4)])
