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
- Settings: a rate outside [0, 1), a rate in (0, 1) (not supported yet) and a negative
  threshold are refused naming the setting, through the config and the request.
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
from apbv.engine.request import Request
from apbv.positions import mrope_positions
from apbv.video import DecodedVideo, Sampling
from apbv.video.prune import keep_mask, kept_split, pruned_grid, signatures

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
    ("video.pruning_rate=0.5", r"video\.pruning_rate=0\.5 is not supported yet"),
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
