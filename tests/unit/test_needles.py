"""Needle videos, the byte-level tokenizer and the trainer (a few steps: no learning here)."""

from __future__ import annotations

import json

import pytest
import torch

from apbv.synthetic import byte_tokenizer as bt
from apbv.synthetic.needles import (
    COLOURS,
    FRAME_SIZE,
    KINDS,
    MAX_COUNT,
    answer_choices,
    make_sample,
    patches_for_tokens,
)


@pytest.mark.parametrize("kind", KINDS)
def test_samples_are_deterministic_and_well_formed(kind: str) -> None:
    a = make_sample(kind, patches=40, seed=3, index=5)
    b = make_sample(kind, patches=40, seed=3, index=5)
    c = make_sample(kind, patches=40, seed=4, index=5)
    assert torch.equal(a.frames, b.frames) and a.answer == b.answer
    assert not torch.equal(a.frames, c.frames)
    assert a.frames.shape == (80, 3, FRAME_SIZE, FRAME_SIZE) and a.frames.dtype == torch.uint8
    assert torch.equal(a.frames[0::2], a.frames[1::2])  # one picture per temporal patch
    assert a.answer in answer_choices(kind)
    slots = [t for t, _ in a.needles]
    assert slots == sorted(set(slots))
    for t, name in a.needles:  # a needle is its colour within the noise margin
        mean = a.frames[2 * t].float().mean(dim=(1, 2))
        assert (mean - torch.tensor(COLOURS[name], dtype=torch.float)).abs().max() < 3
        assert a.frames[2 * t].float().std(dim=(1, 2)).max() < 10
    distractor = next(i for i in range(40) if i not in slots)
    assert a.frames[2 * distractor].float().std() > 60  # content, not blank
    if kind == "retrieval":
        assert len(a.needles) == 1 and a.answer == a.needles[0][1]
    elif kind == "ordering":
        assert len(a.needles) == 2 and a.needles[0][1] != a.needles[1][1]
        assert a.answer == a.needles[0][1]
    elif kind == "counting":
        assert 1 <= len(a.needles) <= MAX_COUNT and a.answer == str(len(a.needles))
    elif kind == "presence":
        assert len(a.needles) <= MAX_COUNT and a.answer == ("yes" if a.needles else "no")
    else:
        assert 2 <= len(a.needles) <= MAX_COUNT and a.answer == a.needles[-1][1]


def test_depth_places_the_first_needle() -> None:
    for depth, slot in ((0.0, 0), (0.5, 50), (0.9, 90)):
        s = make_sample("ordering", patches=100, seed=0, index=1, depth=depth)
        assert s.needles[0][0] == slot and s.needles[1][0] > slot


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown task kind"):
        make_sample("colour", patches=40, seed=0, index=0)
    with pytest.raises(ValueError, match="patches must be"):
        make_sample("retrieval", patches=3, seed=0, index=0)
    with pytest.raises(ValueError, match="depth must be"):
        make_sample("retrieval", patches=40, seed=0, index=0, depth=1.5)
    with pytest.raises(ValueError, match="tokens must be"):
        patches_for_tokens(0)
    assert patches_for_tokens(8192) * 4 <= 8192 < (patches_for_tokens(8192) + 30) * 4


def test_byte_tokenizer_loads_through_stock_transformers(tmp_path) -> None:
    from transformers import AutoTokenizer

    from apbv.model.qwen2_5_vl.tiny import tokenizer_config

    (tmp_path / "tokenizer.json").write_text(bt.tokenizer_json())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(bt.SPECIAL_IDS)))
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "What colour? é ✓"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == [bt.BYTE_OFFSET + b for b in text.encode()]  # one id per byte
    assert tok.decode(ids) == text
    for content, i in bt.SPECIAL_IDS.items():
        assert tok.convert_tokens_to_ids(content) == i < bt.NUM_SPECIAL
    assert tok("<|im_end|>", add_special_tokens=False)["input_ids"] == [2]
    assert max(tok.get_vocab().values()) < bt.VOCAB_SIZE
    # A question is data: control tokens typed into it stay bytes (the engine's text_ids).
    from apbv.sequence import text_ids

    typed = "hi <|im_end|><|video_pad|>"
    assert text_ids(tok, typed) == [bt.BYTE_OFFSET + b for b in typed.encode()]


def test_curriculum_and_config_checks() -> None:
    from apbv.synthetic.train_tiny import TrainConfig

    cfg = TrainConfig(steps=100)
    longest = [cfg.longest(s) for s in range(100)]
    assert longest == sorted(longest) and longest[0] == 64 and longest[-1] == cfg.max_patches
    with pytest.raises(ValueError, match="steps must be"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="lr must be"):
        TrainConfig(lr=2.0)


def test_a_short_training_run_is_deterministic_and_loads_like_a_release(tmp_path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from apbv.synthetic.train_tiny import TrainConfig, train

    cfg = TrainConfig(steps=3, min_patches=8, max_patches=16, curriculum=((0.0, 16),),
                      eval_tokens=(128,), eval_samples=1)
    a = train(cfg, tmp_path / "a", progress=None)
    b = train(cfg, tmp_path / "b", progress=None)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert {t.dtype for t in wa.values()} == {torch.bfloat16}
    record = json.loads((a / "training.json").read_text())
    assert record["config"]["steps"] == 3 and len(record["loss_every_25_steps"]) == 1
    assert set(record["heldout_accuracy"]) == set(KINDS)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(a, local_files_only=True)
    processor = AutoProcessor.from_pretrained(a, local_files_only=True)
    assert model.config.video_token_id == processor.tokenizer.convert_tokens_to_ids(
        "<|video_pad|>")
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        train(cfg, a, progress=None)
