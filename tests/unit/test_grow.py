"""Growing the tiny model by decoder layers changes none of its answers at step 0."""

from __future__ import annotations

import pytest
import torch

from apbv.synthetic.needles import make_sample


def _shipped_and_encoder():  # type: ignore[no-untyped-def]
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from apbv.assets import needle_tiny
    from apbv.synthetic.train_tiny import Encoder

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        needle_tiny(), local_files_only=True, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(needle_tiny(), local_files_only=True)
    return model, Encoder(processor, model.config)


def test_grown_model_gives_bit_identical_logits_and_trains_only_where_asked() -> None:
    from apbv.synthetic.grow import decoder_layers, grown, param_groups
    from apbv.synthetic.train_tiny import forward

    start, encoder = _shipped_and_encoder()
    model = grown(type(start), start, 2, seed=3).eval()
    old = len(decoder_layers(start))
    assert len(decoder_layers(model)) == old + 2 == model.config.text_config.num_hidden_layers
    assert len(model.config.text_config.layer_types) == old + 2
    new_q = decoder_layers(model)[old].self_attn.q_proj.weight
    assert float(new_q.detach().abs().max()) > 0  # the new layers are not all zero: they can learn
    enc = encoder(make_sample("retrieval", patches=16, seed=7, index=0))
    with torch.no_grad():
        before, after = forward(start, enc).logits, forward(model, enc).logits
    err = float((before - after).abs().max())
    assert torch.equal(before, after), f"grown logits differ from the checkpoint's by {err}"

    groups = param_groups(model, 2, 0.0)
    assert len(groups) == 1 and groups[0]["scale"] == 1.0
    trained = {id(p) for p in groups[0]["params"]}
    assert trained == {id(p) for layer in decoder_layers(model)[old:] for p in layer.parameters()}
    assert not any(p.requires_grad for p in model.parameters() if id(p) not in trained)
    assert [g["scale"] for g in param_groups(grown(type(start), start, 1, 0), 1, 0.5)] == [1.0,
                                                                                          0.5]
    with pytest.raises(ValueError, match=r"old_lr_scale must be in \[0, 1\], got 2"):
        param_groups(model, 2, 2)
    with pytest.raises(ValueError, match="grow must be a positive number of layers, got 0"):
        grown(type(start), start, 0, seed=0)


def test_train_config_takes_growth_only_from_a_checkpoint() -> None:
    from apbv.synthetic.train_tiny import TrainConfig

    assert TrainConfig(init="x", grow=2, old_lr_scale=0.0).grow == 2
    with pytest.raises(ValueError, match="grow must be a layer count >= 0 with init, got 2"):
        TrainConfig(grow=2)
    with pytest.raises(ValueError, match=r"old_lr_scale must be in \[0, 1\] \(below 1 only"):
        TrainConfig(old_lr_scale=0.5)


@pytest.mark.parametrize("bench,kind", [("vnbench", "retrieval"), ("vnbench", "counting"),
                                        ("longvideobench", "presence")])
def test_an_options_sample_is_the_letter_question_without_its_instruction(bench: str,
                                                                          kind: str) -> None:
    from apbv.eval.data import INSTRUCTION
    from apbv.synthetic.choices import choice_sample, options_sample
    from apbv.synthetic.mix import LETTERS, check_entry

    for i in range(4):
        letter = choice_sample(bench, kind, patches=12, seed=2, index=i)
        word = options_sample(bench, kind, patches=12, seed=2, index=i)
        free = make_sample(kind, patches=12, seed=2, index=i)
        assert torch.equal(word.frames, letter.frames)
        assert INSTRUCTION not in word.question and letter.question.startswith(word.question)
        assert letter.question[len(word.question):].strip() == INSTRUCTION
        assert word.answer == free.answer and f"\n{letter.answer}. {word.answer}" in word.question
    for entry in LETTERS:
        check_entry(entry)
    assert sum(e.startswith("free/") for e in LETTERS) == len(LETTERS) // 3
