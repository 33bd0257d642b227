"""apbv.eval.score: the scoring arithmetic on injected rows, and the results file's shape."""

from __future__ import annotations

from collections import defaultdict

import pytest

from apbv.eval.score import compare_exact, results_document, score_rows


def _row(id_: str, correct: bool, *, error: str | None = None, parsed: str | None = "A",
         **fields) -> dict:
    return {"id": id_, "correct": correct, "error": error,
            "parsed_pred": None if error else parsed, **fields}


def _lvb_rows() -> list[dict]:
    spec = [  # (duration group, category, correct, error, parsed letter)
        (15, "T2O", True, None, "A"),
        (15, "T2O", False, None, None),  # unparseable: wrong
        (15, "T3O", True, None, "B"),
        (60, "T3O", False, "video.mp4 does not exist", None),  # failed: wrong, in the count
        (60, "T2O", True, None, "C"),
    ]
    return [_row(f"q{i}", c, error=e, parsed=p, duration_group=g, question_category=cat)
            for i, (g, cat, c, e, p) in enumerate(spec)]


def test_longvideobench_accuracy_and_breakdown() -> None:
    s = score_rows("longvideobench", _lvb_rows())
    assert s["lvb_acc"] == pytest.approx(3 / 5)  # failed samples stay in the denominator
    assert (s["num"], s["correct"], s["errors"], s["unparsed"]) == (5, 3, 1, 1)
    assert s["duration_group"] == {"15": {"num": 3, "correct": 2, "acc": pytest.approx(2 / 3)},
                                   "60": {"num": 2, "correct": 1, "acc": 0.5}}
    assert s["question_category"]["T2O"] == {"num": 3, "correct": 2,
                                             "acc": pytest.approx(2 / 3)}
    assert s["question_category"]["T3O"]["acc"] == 0.5


def _vnb_rows() -> list[dict]:
    """Per question (video, type): the correctness of its tries (None: the try failed)."""
    questions = {
        ("v1", "ret_insert1"): [True, True, True, True],
        ("v2", "ret_insert1"): [True, True, False, True],
        ("v3", "ret_edit1"): [True, True, True, True],
        ("v4", "ord_insert1"): [True, None, True, True],  # one failed try sinks the question
        ("v5", "cnt_edit1"): [True, True, True, True],
        ("v6", "cnt_edit1"): [True, True],  # cut short by --limit: not scored
    }
    rows = []
    for (video, task_type), tries in questions.items():
        for t, ok in enumerate(tries):
            qid = f"{video}_{task_type}_{t}"
            rows.append(_row(qid, bool(ok), error=None if ok is not None else "bad video",
                             video=f"./VNBench/{video}.mp4", type=task_type, question_id=qid,
                             **{"try": t}))
    return rows


def test_vnbench_four_try_rule_and_category_means() -> None:
    s = score_rows("vnbench", _vnb_rows())
    assert s["types"] == {
        "cnt_edit1": {"questions": 1, "correct": 1, "acc": 1.0},
        "ord_insert1": {"questions": 1, "correct": 0, "acc": 0.0},
        "ret_edit1": {"questions": 1, "correct": 1, "acc": 1.0},
        "ret_insert1": {"questions": 2, "correct": 1, "acc": 0.5},
    }
    assert s["vnbench_ret"] == pytest.approx((0.5 + 1.0) / 2)  # the mean of its types
    assert s["vnbench_ord"] == 0.0 and s["vnbench_cnt"] == 1.0
    assert s["vnbench_acc"] == pytest.approx((0.75 + 0.0 + 1.0) / 3)  # the mean of the three
    assert (s["questions"], s["incomplete_questions"], s["num"], s["errors"]) == (5, 1, 22, 1)
    assert s["try_acc"] == pytest.approx(20 / 22)


def test_vnbench_per_type_matches_videoniah_eval_py_on_the_same_rows() -> None:
    """VideoNIAH's evaluation/eval.py groups by question_id[:-2], cuts pred at the first ".",
    maps it by substring test A->B->C->D and needs all 4 tries right. Fed rows whose pred is a
    letter, it must agree with ours on every type whose questions all ran."""
    rows = [r for r in _vnb_rows() if not r["id"].startswith("v6")]
    for r in rows:
        r["gt"] = "B"
        r["pred"] = "B. yes" if r["correct"] else ""
    acc: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in rows:
        pred = r["pred"].split(".")[0]
        letter = next((c for c in "ABCD" if c in pred), pred)
        acc[r["type"]][r["question_id"][:-2]] += r["gt"] == letter
    theirs = {t: sum(v == 4 for v in q.values()) / len(q) for t, q in acc.items()}
    ours = {t: s["acc"] for t, s in score_rows("vnbench", rows)["types"].items()}
    assert ours == theirs


def test_compare_exact_agreement_and_exact_scores() -> None:
    rows = _lvb_rows()
    exacts = [
        {"parsed_pred": "A", "correct": True, "same_letter": True, "same_tokens": True},
        {"parsed_pred": "B", "correct": True, "same_letter": False, "same_tokens": False},
        {"parsed_pred": "B", "correct": True, "same_letter": True, "same_tokens": False},
        None,  # the sample failed: no exact call
        {"parsed_pred": None, "correct": False, "same_letter": False, "same_tokens": False},
    ]
    for r, e in zip(rows, exacts):
        r["exact"] = None if e is None else {**e, "error": None}
    c = compare_exact("longvideobench", rows)
    assert c["compared"] == 4
    assert c["letter_agreement"] == 0.5 and c["token_agreement"] == 0.25
    assert c["exact_scores"]["lvb_acc"] == pytest.approx(3 / 5)
    assert (c["exact_scores"]["errors"], c["exact_scores"]["unparsed"]) == (1, 1)


def test_results_document_is_lmms_eval_shaped() -> None:
    rows = _lvb_rows()
    doc = results_document("longvideobench", rows, total=7, config={"model": "apbv"},
                           generation={"max_new_tokens": 32}, compared=False)
    task = doc["results"]["longvideobench_val_v"]
    assert task["alias"] == "longvideobench_val_v"
    assert task["lvb_acc,none"] == pytest.approx(0.6) and task["lvb_acc_stderr,none"] == "N/A"
    assert doc["n-samples"] == {"longvideobench_val_v": {"original": 7, "effective": 5}}
    assert doc["higher_is_better"] == {"longvideobench_val_v": {"lvb_acc": True}}
    assert doc["configs"]["longvideobench_val_v"]["generation_kwargs"] == {"max_new_tokens": 32}
    assert doc["apbv"]["scores"]["errors"] == 1 and "compare_exact" not in doc["apbv"]
    vnb = results_document("vnbench", _vnb_rows(), total=24, config={}, generation={},
                           compared=False)["results"]["vnbench"]
    assert [k for k in vnb if not k.endswith("_stderr,none")] == [
        "alias", "vnbench_acc,none", "vnbench_ret,none", "vnbench_ord,none", "vnbench_cnt,none"]
    with pytest.raises(ValueError, match="unknown benchmark 'mmlu'; allowed: longvideobench"):
        score_rows("mmlu", rows)
