"""The tiny model's new training data: multiple-choice needle questions in the benchmarks'
prompt formats (the harness's own text, the letter the right option's), the static-camera
needle videos (an event the pruning rule keeps, sensor noise it drops), the training mix and
the pruned encoding's positions, and the needle fixtures read back by the harness."""

from __future__ import annotations

import re

import pytest
import torch

from apbv.eval.data import choice_prompt, load_samples
from apbv.synthetic.camera import CAMERA_KINDS, QUESTIONS, camera_sample
from apbv.synthetic.choices import CHOICE_KINDS, choice_sample, named_sample
from apbv.synthetic.eval_fixtures import make_eval_fixtures
from apbv.synthetic.mix import (
    MIXES,
    SCHEDULE,
    TRAIN_THRESHOLDS,
    check_entry,
    make_task,
    schedule,
)
from apbv.synthetic.needles import COLOURS, make_sample
from apbv.video.prune import keep_mask, signatures


def _options(prompt: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-E])\. (.*)$", prompt, flags=re.MULTILINE))


@pytest.mark.parametrize("bench", sorted(CHOICE_KINDS))
def test_a_choice_question_is_the_harness_text_and_its_letter_names_the_answer(bench) -> None:
    for kind in CHOICE_KINDS[bench]:
        letters = set()
        for i in range(12):
            s = choice_sample(bench, kind, patches=16, seed=3, index=i)
            plain = make_sample(kind, patches=16, seed=3, index=i)
            options = _options(s.question)
            assert options[s.answer] == plain.answer, (bench, kind, i, s.question)
            assert s.question == choice_prompt(bench, plain.question, list(options.values()))
            assert torch.equal(s.frames, plain.frames) and len(set(options.values())) == \
                len(options)
            if bench == "vnbench":
                assert len(options) == 4
            again = choice_sample(bench, kind, patches=16, seed=3, index=i)
            assert (again.question, again.answer) == (s.question, s.answer)
            letters.add(s.answer)
        assert len(letters) >= 2, (bench, kind, letters)  # the right option moves
    assert choice_sample("longvideobench", "retrieval", patches=16, seed=0,
                         index=0).question.endswith("directly.\n")
    with pytest.raises(ValueError, match="vnbench asks no 'presence' question; allowed"):
        choice_sample("vnbench", "presence", patches=16, seed=0, index=0)


@pytest.mark.parametrize("kind", CAMERA_KINDS)
def test_a_static_camera_keeps_its_event_and_drops_its_noise(kind: str) -> None:
    for i in range(4):
        s = camera_sample(kind, patches=48, seed=5, index=i, colour="magenta")
        assert (s.answer, s.question, s.frames.shape) == ("magenta", QUESTIONS[kind],
                                                          (96, 3, 56, 56))
        assert torch.equal(s.frames, camera_sample(kind, patches=48, seed=5, index=i,
                                                   colour="magenta").frames)
        first = s.needles[0][0]
        quiet = s.frames[0:2 * first].float()  # the scene before the event: noise only
        assert 0.5 < float((quiet[1:] - quiet[:-1]).abs().mean()) < 6
        keep = keep_mask(signatures(s.frames, 2, (2, 2)), 8.0)
        assert keep[first], (kind, i)  # magenta stands out of any scene at 8 levels
        assert sum(keep) <= 12, (kind, i, sum(keep))  # noise, grain and drift mostly not
    drawn = {camera_sample(kind, patches=16, seed=0, index=i).answer for i in range(24)}
    assert len(drawn) >= 6 and drawn <= set(COLOURS)


def test_the_training_mix_names_valid_tasks() -> None:
    for entry in set(SCHEDULE):
        check_entry(entry)
        task = make_task(entry, patches=20, seed=0, index=1)
        assert (task.threshold in TRAIN_THRESHOLDS) == entry.endswith("/pruned")
    with pytest.raises(ValueError, match="must be free/KIND"):
        check_entry("camera/flash/blurred")
    assert schedule("choice-camera") == SCHEDULE and len(set(SCHEDULE)) == 14
    assert all(e.startswith("free/") for e in schedule("needles"))  # the shipped recipe
    from apbv.synthetic.train_tiny import TrainConfig

    assert TrainConfig().mix == "needles" and set(MIXES) == {
        "needles", "choice-camera", "letters", "camera", "camera-settle", "named", "joint"}
    check_entry("lookup")
    with pytest.raises(AssertionError, match="a lookup step has no video task"):
        make_task("lookup", patches=20, seed=0, index=1)
    assert schedule("joint")[1::3] == ("lookup",) * 10
    with pytest.raises(ValueError, match="unknown training mix 'cats'; allowed: needles"):
        TrainConfig(mix="cats")


def test_a_named_answer_is_the_option_text_then_the_letter_the_harness_reads() -> None:
    from apbv.eval.parse import parse_choice
    from apbv.synthetic.mix import as_form, heldout_tasks

    for bench in sorted(CHOICE_KINDS):
        for kind in CHOICE_KINDS[bench]:
            for i in range(6):
                named = named_sample(bench, kind, patches=16, seed=3, index=i)
                letter = choice_sample(bench, kind, patches=16, seed=3, index=i)
                word = make_sample(kind, patches=16, seed=3, index=i).answer
                assert named.question == letter.question, (bench, kind, i)
                assert named.answer == f"{word} ({letter.answer})", (bench, kind, i)
                assert _options(named.question)[letter.answer] == word
                assert parse_choice(named.answer, "ABCDE") == letter.answer, named.answer
    assert schedule("named")[1::2] == tuple(as_form(e, "named") for e in schedule("named")[1::2])
    assert {e.split("/")[0] for e in schedule("named")} == {"free", "named"}
    from apbv.synthetic.mix import answer_form

    assert [answer_form(m) for m in ("named", "joint", "letters", "needles")] == [
        "named", "named", "choice", "choice"]
    assert as_form("choice/vnbench/counting", "named") == "named/vnbench/counting"
    assert as_form("free/retrieval", "named") == "free/retrieval"
    (task,) = heldout_tasks("named/longvideobench/presence", 16, 1, 0, False)
    assert task.sample.answer in ("yes (A)", "yes (B)", "no (A)", "no (B)")


def test_a_pruned_training_sample_keeps_its_patches_positions() -> None:
    from transformers import AutoProcessor

    from apbv.assets import needle_tiny
    from apbv.synthetic.train_tiny import Encoder, trained_config

    encoder = Encoder(AutoProcessor.from_pretrained(needle_tiny(), local_files_only=True),
                      trained_config())
    sample = camera_sample("flash", patches=24, seed=1, index=0)
    whole, pruned = encoder(sample), encoder(sample, threshold=8.0)
    keep = keep_mask(signatures(sample.frames, 2, (2, 2)), 8.0)
    kept = [i for i, k in enumerate(keep) if k]
    assert pruned.grid.tolist() == [[len(kept), 4, 4]] and 1 < len(kept) < 24
    video = encoder.video_token_id
    pos_whole = whole.positions[:, 0, whole.input_ids[0] == video].view(3, 24, 4)
    pos_pruned = pruned.positions[:, 0, pruned.input_ids[0] == video].view(3, len(kept), 4)
    assert torch.equal(pos_pruned, pos_whole[:, kept])
    assert whole.input_ids.shape[1] - pruned.input_ids.shape[1] == 4 * (24 - len(kept))


def test_needle_fixtures_read_back_with_the_training_prompts(tmp_path) -> None:
    lvb = make_eval_fixtures("longvideobench", tmp_path / "lvb", count=3, videos="needles")
    vnb = make_eval_fixtures("vnbench", tmp_path / "vnb", count=1, videos="needles",
                             types=("cnt_insert1",))
    samples = load_samples("longvideobench", lvb.parent)
    assert [s.fields["question_category"] for s in samples] == ["retrieval", "counting",
                                                                 "presence"]
    for s in samples + load_samples("vnbench", vnb.parent):
        options = _options(s.prompt)
        question = s.prompt.split("\n", 1)[0]
        bench = "vnbench" if "VNBench" in s.video_path else "longvideobench"
        assert s.prompt == choice_prompt(bench, question, list(options.values()))
        assert options[s.gt] in COLOURS or options[s.gt] in ("1", "2", "3", "4", "yes", "no")
    import av

    with av.open(samples[0].video_path) as container:  # nearly lossless: noise stays noise
        decoded = torch.stack([torch.from_numpy(f.to_ndarray(format="rgb24")).permute(2, 0, 1)
                               for f in container.decode(video=0)])
    first = make_sample("retrieval", patches=32, seed=5_000_011, index=0).frames
    assert decoded.shape == first.shape
    error = float((decoded.float() - first.float()).abs().mean())
    assert error < 3, f"mean decoded error {error:.2f} levels"
    with pytest.raises(ValueError, match="unknown fixture videos 'cats'; allowed: squares"):
        make_eval_fixtures("vnbench", tmp_path / "x", videos="cats")


def test_the_camera_checkpoint_records_the_two_steps_that_made_it() -> None:
    """``camera-tiny``'s record names what ``train-tiny`` reruns: its mix's schedule as the
    code defines it, its start (a ``--mix camera`` continuation of ``needle-tiny``) and
    free-form and camera figures beside the starting weights'."""
    import json

    from apbv.assets import CAMERA_TINY, NEEDLE_TINY

    record = json.loads((CAMERA_TINY / "training.json").read_text())
    assert record["config"]["mix"] == "camera-settle"
    assert tuple(record["mix"]["schedule"]) == schedule("camera-settle")
    assert "--init apbv/assets/needle-tiny --mix camera " in record["init_command"]
    assert set(record["heldout_accuracy"]) == set(record["init_heldout_accuracy"])
    assert record["heldout_mix_accuracy"]["camera/object/pruned"]
    shipped = json.loads((NEEDLE_TINY / "config.json").read_text())
    assert json.loads((CAMERA_TINY / "config.json").read_text())["text_config"][
        "num_hidden_layers"] == shipped["text_config"]["num_hidden_layers"]
    assert {e.split("/")[0] for e in schedule("camera")} == {"free", "camera"}
