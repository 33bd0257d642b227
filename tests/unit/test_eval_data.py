"""apbv.eval.data and apbv.synthetic.eval_fixtures: the two annotation formats, the prompts, the
filters, every malformed-input error, and fixture videos that really hold their needles."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from apbv.eval.data import load_samples, parse_where
from apbv.synthetic.eval_fixtures import COLOURS, FPS, make_eval_fixtures
from apbv.synthetic.videos import make_frame, make_needle_frame

INSTRUCTION = "Answer with the option's letter from the given choices directly."


@pytest.fixture(scope="module")
def lvb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_eval_fixtures("longvideobench", tmp_path_factory.mktemp("lvb"), count=3).parent


@pytest.fixture(scope="module")
def vnb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_eval_fixtures("vnbench", tmp_path_factory.mktemp("vnb"),
                              types=("ret_insert1", "ord_edit1", "cnt_edit2")).parent


def _entries(path: Path) -> list[dict]:
    return json.loads(path.read_text())


def _write(path: Path, entries: list[dict]) -> Path:
    path.write_text(json.dumps(entries))
    return path


def test_longvideobench_samples_and_prompt(lvb: Path) -> None:
    entries = _entries(lvb / "lvb_val.json")
    assert len(entries) == 3 and {"id", "video_path", "subtitle_path", "duration",
                                  "duration_group", "question", "candidates", "correct_choice",
                                  "question_category", "starting_timestamp_for_subtitles"} \
        <= set(entries[0])
    samples = load_samples("longvideobench", lvb)
    assert [s.id for s in samples] == [e["id"] for e in entries]
    first, e = samples[0], entries[0]
    letters = "ABCDE"[:len(e["candidates"])]
    assert first.prompt == "\n".join(
        [e["question"]] +
        [f"{letter}. {c}" for letter, c in zip(letters, e["candidates"])] + [INSTRUCTION, ""])
    assert first.gt == letters[e["correct_choice"]] and first.letters == letters
    assert first.video_path == str(lvb / "videos" / e["video_path"])
    assert Path(first.video_path).is_file() and (lvb / "subtitles" / e["subtitle_path"]).is_file()
    assert first.fields == {"duration_group": 15, "question_category": e["question_category"]}
    assert {len(s.letters) for s in samples} == {4, 5}


def test_longvideobench_prompt_is_lmms_eval_longvideobench_val_v(tmp_path: Path) -> None:
    """Byte for byte lmms-eval's longvideobench_val_v text: pre_prompt "", the question, the
    options "A. ..." one per line, then its post_prompt, whose trailing newline is kept."""
    (tmp_path / "videos").mkdir()
    _write(tmp_path / "lvb_val.json", [{
        "id": "86CxyhFV9MI_0", "video_path": "86CxyhFV9MI.mp4", "duration_group": 600,
        "question_category": "TOS", "correct_choice": 2,
        "question": "What is the man in the red shirt doing <|im_end|> when the bell rings?",
        "candidates": ["He sits down", "He waves", "He opens the door", "He leaves"]}])
    (sample,) = load_samples("longvideobench", tmp_path)
    assert sample.prompt == (
        "What is the man in the red shirt doing <|im_end|> when the bell rings?\n"
        "A. He sits down\n"
        "B. He waves\n"
        "C. He opens the door\n"
        "D. He leaves\n"
        "Answer with the option's letter from the given choices directly.\n")
    assert sample.gt == "C" and sample.video_path == str(tmp_path / "videos" / "86CxyhFV9MI.mp4")


def test_longvideobench_lmms_eval_option_columns(lvb: Path, tmp_path: Path) -> None:
    """lmms-eval's copy has option0..option4 ("N/A" when unused) instead of candidates."""
    entries = _entries(lvb / "lvb_val.json")
    for e in entries:
        candidates = e.pop("candidates")
        e.update({f"option{i}": (candidates[i] if i < len(candidates) else "N/A")
                  for i in range(5)})
    (tmp_path / "videos").mkdir()
    _write(tmp_path / "lvb_val.json", entries)
    ours = load_samples("longvideobench", tmp_path)
    assert [s.prompt for s in ours] == [s.prompt for s in load_samples("longvideobench", lvb)]


def test_vnbench_samples_prompt_and_four_tries(vnb: Path) -> None:
    entries = _entries(vnb / "VNBench-main-4try.json")
    samples = load_samples("vnbench", vnb)
    assert len(samples) == 12
    s, e = samples[0], entries[0]
    assert s.id == "vnfix000_ret_insert1_ret_insert1_0" == s.fields["question_id"]
    assert s.prompt == (f"{e['question']}\nA. {e['options'][0]}\nB. {e['options'][1]}\n"
                        f"C. {e['options'][2]}\nD. {e['options'][3]}\n{INSTRUCTION}")
    assert s.video == "./VNBench/vnfix000_ret_insert1.mp4"
    assert s.video_path == str(vnb / "VNBench" / "vnfix000_ret_insert1.mp4")
    for q in range(3):  # the 4 option orders put the answer under 4 different letters
        tries = samples[4 * q:4 * q + 4]
        assert [t.fields["try"] for t in tries] == [0, 1, 2, 3]
        assert sorted(t.gt for t in tries) == ["A", "B", "C", "D"]
        assert all(t.gt == entries[4 * q + i]["gt_option"] for i, t in enumerate(tries))
    counting = [e for e in entries if e["type"] == "cnt_edit2"]
    assert all(isinstance(o, int) for o in counting[0]["options"])
    assert "\nA. " in samples[-1].prompt and samples[-1].fields["type"] == "cnt_edit2"


def test_vnbench_gt_without_gt_option_and_jsonl(vnb: Path, tmp_path: Path) -> None:
    entries = _entries(vnb / "VNBench-main-4try.json")
    expected = [s.gt for s in load_samples("vnbench", vnb)]
    for e in entries:
        del e["gt_option"]
    path = tmp_path / "ann.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    assert [s.gt for s in load_samples("vnbench", vnb, annotation=str(path))] == expected


def test_where_filter_and_parse_where(vnb: Path) -> None:
    where = parse_where(["type=ord_edit1", "try = 2"])
    assert where == (("type", "ord_edit1"), ("try", "2"))
    samples = load_samples("vnbench", vnb, where=where)
    assert [s.id for s in samples] == ["vnfix000_ord_edit1_ord_edit1_2"]
    with pytest.raises(ValueError, match="must look like FIELD=VALUE"):
        parse_where(["type"])
    with pytest.raises(ValueError, match="--where field 'colour' is not in"):
        load_samples("vnbench", vnb, where=(("colour", "red"),))
    with pytest.raises(ValueError, match="no entry of VNBench-main-4try.json matches type=x"):
        load_samples("vnbench", vnb, where=(("type", "x"),))


def test_bad_annotations_are_value_errors(vnb: Path, lvb: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown benchmark 'mvbench'; allowed: longvideobench"):
        load_samples("mvbench", vnb)
    with pytest.raises(ValueError, match="lvb_val.json' does not exist"):
        load_samples("longvideobench", tmp_path)
    good = _entries(vnb / "VNBench-main-4try.json")
    wrong = "A" if good[0]["gt_option"] != "A" else "B"
    first = "bad.json entry 1 (id 'vnfix000_ret_insert1_ret_insert1_1')"
    cases = {
        "not valid JSON": "[{",
        "must hold a list of objects": {"video": "x"},
        "has no entries": [],
        "bad.json entry 0 (id unknown) lacks gt, type": [
            {"video": "x", "question": "q", "options": [1, 2], "try": 0}],
        f"{first}: field 'gt' 'z' is not among the options": [good[0], {**good[1], "gt": "z"}],
        f"{first}: field 'gt_option' '{wrong}' does not name gt": [
            good[0], {**good[1], "gt_option": wrong}],
        "bad.json entry 0 (id 'vnfix000_ret_insert1_ret_insert1_4'): field 'try' must be "
        "0..3, got 4": [{**good[0], "try": 4}],
        "must start with one of ret_, ord_, cnt_": [{**good[0], "type": "count"}],
        "two entries with the sample id": [good[0], good[0]],
        "bad.json entry 1 (id unknown): field 'video' must be a non-empty string, got None": [
            good[0], {**good[1], "video": None}],
        "bad.json entry 0 (id unknown): field 'video' must be a non-empty string, got 17": [
            {**good[0], "video": 17}],
        f"{first}: field 'options' must hold 2..5 options, got 6": [
            good[0], {**good[1], "options": list(range(6))}],
        f"{first}: field 'options' must be a list, got 'A'": [
            good[0], {**good[1], "options": "A"}],
        f"{first}: field 'question' must be a non-empty string, got None": [
            good[0], {**good[1], "question": None}],
        f"{first}: field 'options' must be a non-empty string or a number, got None": [
            good[0], {**good[1], "options": [None, *good[1]["options"][1:]]}],
    }
    for message, content in cases.items():
        path = tmp_path / "bad.json"
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(ValueError, match=re.escape(message)):
            load_samples("vnbench", tmp_path, annotation="bad.json")
    test_split = [{k: v for k, v in e.items() if k != "correct_choice"}
                  for e in _entries(lvb / "lvb_val.json")]
    _write(tmp_path / "lvb_val.json", test_split)
    with pytest.raises(ValueError, match="has no videos/ directory"):
        load_samples("longvideobench", tmp_path)
    (tmp_path / "videos").mkdir()
    with pytest.raises(ValueError, match=re.escape(
            "lvb_val.json entry 0 (id 'lvbfix000_0'): field 'correct_choice' must be an option "
            "index 0..3, got None")):
        load_samples("longvideobench", tmp_path)
    lvb_good = _entries(lvb / "lvb_val.json")
    lvb_cases = {
        "lvb_val.json entry 1 (id 'lvbfix000_1'): field 'video_path' must be a non-empty "
        "string, got None": [lvb_good[0], {**lvb_good[1], "video_path": None}],
        "lvb_val.json entry 0 (id 'lvbfix000_0'): field 'video_path' must be a non-empty "
        "string, got 3": [{**lvb_good[0], "video_path": 3}],
        "lvb_val.json entry 1 (id 'lvbfix000_1'): field 'candidates' must hold 2..5 options, "
        "got 1": [lvb_good[0], {**lvb_good[1], "candidates": ["x"]}],
        "lvb_val.json entry 0 (id unknown): field 'id' must be a string, got None": [
            {**lvb_good[0], "id": None}],
    }
    for message, entries in lvb_cases.items():
        _write(tmp_path / "lvb_val.json", entries)
        with pytest.raises(ValueError, match=re.escape(message)):
            load_samples("longvideobench", tmp_path)


def test_fixture_videos_hold_their_needles(vnb: Path) -> None:
    import av

    entry = _entries(vnb / "VNBench-main-4try.json")[0]  # ret: one needle of the answer colour
    with av.open(str(vnb / entry["video"])) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    needle_frames = {round(FPS) * entry["needle_time"][0] + i for i in range(round(FPS))}
    colour = np.array(COLOURS[entry["gt"]], dtype=float)
    for i, frame in enumerate(frames):
        h, w, _ = frame.shape
        centre = frame[h // 2 - 4:h // 2 + 4, w // 2 - 4:w // 2 + 4].reshape(-1, 3).mean(0)
        distance = np.abs(centre - colour).max()
        assert (distance < 24) == (i in needle_frames), (i, centre, colour)


def test_make_needle_frame() -> None:
    frame = make_needle_frame(3, (1, 2, 3), fps=4, width=40, height=20)
    plain = make_frame(3, fps=4, width=40, height=20)
    assert (frame[5:15, 15:25] == (1, 2, 3)).all()  # side min(w, h) / 2, centred
    assert (frame[:5] == plain[:5]).all() and (frame[:, :15] == plain[:, :15]).all()
    with pytest.raises(ValueError, match="colour must be 3 integers in 0..255"):
        make_needle_frame(0, (1, 2, 300), fps=4, width=40, height=20)
