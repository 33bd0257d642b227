"""The standing-question kinds of the needle videos (presence, most recent flash), the
per-sample answer loss, continuing training from a checkpoint, and the per-class benchmark's
class-balanced draw."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from apbv.synthetic.needles import (
    COLOURS,
    KINDS,
    MAX_COUNT,
    QUESTIONS,
    answer_choices,
    answer_of,
    make_sample,
    patches_for_tokens,
)

ROOT = Path(__file__).resolve().parents[2]


def test_presence_asks_whether_there_is_a_flash_at_all() -> None:
    assert answer_choices("presence") == ("yes", "no")
    assert QUESTIONS["presence"] == "Is there a flash?"
    samples = [make_sample("presence", patches=24, seed=0, index=i) for i in range(40)]
    answers = Counter(s.answer for s in samples)
    assert set(answers) == {"yes", "no"} and min(answers.values()) >= 10  # both, balanced
    for s in samples:
        assert (s.answer == "no") == (len(s.needles) == 0) and len(s.needles) <= MAX_COUNT
        if not s.needles:  # no flash: every patch is noise
            assert s.frames[0::2].float().std(dim=(2, 3)).min() > 60
    with_depth = make_sample("presence", patches=24, seed=0,
                             index=next(i for i, s in enumerate(samples) if s.answer == "no"),
                             depth=0.5)
    assert with_depth.needles == () and with_depth.answer == "no"


def test_recent_asks_for_the_last_of_several_flashes() -> None:
    assert answer_choices("recent") == tuple(COLOURS)
    seen = set()
    for i in range(40):
        s = make_sample("recent", patches=24, seed=1, index=i, depth=0.25)
        colours = [c for _, c in s.needles]
        assert 2 <= len(colours) <= MAX_COUNT and len(set(colours)) == len(colours)
        assert s.answer == colours[-1] != colours[0] and s.needles[0][0] == 6
        seen.add(s.answer)
    assert len(seen) >= 6


@pytest.mark.parametrize("kind", KINDS)
def test_answer_of_is_make_samples_answer_without_the_frames(kind: str) -> None:
    for i in range(12):
        for depth in (None, 0.7):
            sample = make_sample(kind, patches=16, seed=9, index=i, depth=depth)
            assert answer_of(kind, patches=16, seed=9, index=i, depth=depth) == sample.answer
    with pytest.raises(ValueError, match="unknown task kind"):
        answer_of("colour", patches=16, seed=0, index=0)


def test_answer_loss_counts_every_sample_once() -> None:
    from apbv.synthetic.train_tiny import answer_loss

    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11)
    labels = torch.full((2, 6), -100)
    labels[0, 2:6] = torch.tensor([1, 2, 3, 4])  # a 3-token answer (logits 1..4 predict it)
    labels[1, 5] = 7  # a 1-token answer
    ce = torch.nn.functional.cross_entropy
    first = ce(logits[0, 1:5], labels[0, 2:6])
    second = ce(logits[1, 4:5], labels[1, 5:6])
    assert torch.allclose(answer_loss(logits, labels), (first + second) / 2)
    by_token = ce(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
    assert not torch.allclose(answer_loss(logits, labels), by_token)


def test_training_continues_from_a_checkpoint(tmp_path) -> None:
    import hashlib

    from safetensors.torch import load_file

    from apbv.assets import needle_tiny
    from apbv.synthetic.train_tiny import TrainConfig, train

    init = needle_tiny()
    cfg = TrainConfig(steps=1, min_patches=8, max_patches=16, curriculum=((0.0, 16),),
                      eval_tokens=(128,), eval_samples=1, lr=1e-9, init=str(init))
    out = train(cfg, tmp_path / "ft", progress=None)
    record = json.loads((out / "training.json").read_text())
    weights = (init / "model.safetensors").read_bytes()
    assert record["init_weights_sha256"] == hashlib.sha256(weights).hexdigest()
    assert record["config"]["init"] == str(init)
    assert set(record["heldout_right_of_count_per_answer"]) == set(KINDS)
    before, after = load_file(init / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()  # a step of a vanishing rate: the weights it began at
    assert all((before[k].float() - after[k].float()).abs().max() < 1e-6 for k in before)
    with pytest.raises(ValueError, match="holds no model.safetensors"):
        train(TrainConfig(steps=1, init=str(tmp_path)), tmp_path / "none", progress=None)


def test_the_per_class_benchmark_draws_every_class_equally() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fidelity_classes
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    jobs = fidelity_classes.class_jobs([256], 3, [0.1, 0.9], seed=5)
    for kind in fidelity_classes.KINDS:
        mine = [j for j in jobs if j["kind"] == kind]
        assert Counter(j["class"] for j in mine) == {c: 3 for c in answer_choices(kind)}
        for j in mine:
            sample = make_sample(kind, patches=patches_for_tokens(j["tokens"]), seed=5,
                                 index=j["index"], depth=j["depth"])
            assert sample.answer == j["class"]
