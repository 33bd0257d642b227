"""apbv.eval.score: the scoring arithmetic on injected rows, and the results file's shape."""

from __future__ import annotations

import pytest

from apbv.eval.score import compare_exact, letters_agree, results_document, score_rows


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
    # Overall: the mean over the 4 types present (VideoNIAH's eval.py), not the mean of the
    # three category means ((0.75 + 0.0 + 1.0) / 3): a subset of types weighs each type alike.
    assert s["vnbench_acc"] == pytest.approx((0.5 + 1.0 + 0.0 + 1.0) / 4)
    assert (s["questions"], s["incomplete_questions"], s["num"], s["errors"]) == (5, 1, 22, 1)
    assert s["try_acc"] == pytest.approx(20 / 22)


def videoniah_eval_py(rows: list[dict]) -> tuple[dict[str, float], float]:
    """An independent re-implementation of VideoNIAH's evaluation/eval.py on JSONL rows: skip
    rows whose pred is None; per type, group by question_id[:-2]; cut pred at its first ".";
    map it by substring test A, then B, C, D; a question is right when all 4 of its tries are;
    the type's accuracy is right questions / questions; Overall the plain mean of the types'
    accuracies, over the types that occur."""
    tallies: dict[str, dict[str, int]] = {}
    for r in rows:
        if r["pred"] is None:
            continue
        pred = r["pred"].split(".")[0]
        for letter in "ABCD":
            if letter in pred:
                pred = letter
                break
        per_question = tallies.setdefault(r["type"], {})
        name = r["question_id"][:-2]
        per_question[name] = per_question.get(name, 0) + (r["gt"] == pred)
    types = {t: sum(n == 4 for n in q.values()) / len(q) for t, q in sorted(tallies.items())}
    return types, sum(types.values()) / len(types)


def _with_letter_preds(rows: list[dict]) -> list[dict]:
    for r in rows:
        r["gt"] = "B"
        r["pred"] = "B. yes" if r["correct"] else ""
    return rows


def test_vnbench_matches_videoniah_eval_py_on_the_same_rows() -> None:
    """Fed rows whose pred is a letter, eval.py's per-type accuracies and Overall must equal
    ours on every run whose questions all ran: here 4 of the 9 types (2 ret, 1 ord, 1 cnt)."""
    rows = _with_letter_preds([r for r in _vnb_rows() if not r["id"].startswith("v6")])
    theirs, overall = videoniah_eval_py(rows)
    scores = score_rows("vnbench", rows)
    assert {t: s["acc"] for t, s in scores["types"].items()} == theirs
    assert scores["vnbench_acc"] == pytest.approx(overall)


@pytest.mark.parametrize("types", [
    ("ret_insert1", "cnt_edit1", "cnt_edit2"),  # mean of category means would differ
    ("ord_insert1",),
    ("ret_insert1", "ret_insert2", "ret_edit1", "ord_insert1", "ord_insert2", "ord_edit1",
     "cnt_insert1", "cnt_edit1", "cnt_edit2"),
])
def test_vnbench_overall_on_subsets_matches_videoniah_eval_py(types: tuple[str, ...]) -> None:
    rows = []
    for k, task_type in enumerate(types):
        for q in range(k + 2):  # 2, 3, ... questions per type; question q has q wrong tries
            for t in range(4):
                qid = f"v{k}q{q}_{task_type}_{t}"
                rows.append(_row(qid, t >= q % 3, video=f"./VNBench/v{k}q{q}.mp4",
                                 type=task_type, question_id=qid, **{"try": t}))
    rows = _with_letter_preds(rows)
    theirs, overall = videoniah_eval_py(rows)
    scores = score_rows("vnbench", rows)
    assert {t: s["acc"] for t, s in scores["types"].items()} == theirs
    assert scores["vnbench_acc"] == pytest.approx(overall)
    if types[0] == "ret_insert1" and len(types) == 3:
        means = (theirs["ret_insert1"] + (theirs["cnt_edit1"] + theirs["cnt_edit2"]) / 2) / 2
        assert scores["vnbench_acc"] != pytest.approx(means)


def test_compare_exact_agreement_and_exact_scores() -> None:
    rows = _lvb_rows()
    exacts = [  # the mode's letters: A, None, B, (failed), C
        {"parsed_pred": "A", "correct": True, "same_tokens": True},  # agree
        {"parsed_pred": None, "correct": False, "same_tokens": True},  # both unparsed
        {"parsed_pred": "A", "correct": False, "same_tokens": False},  # disagree
        None,  # the sample failed: no exact call
        {"parsed_pred": None, "correct": False, "same_tokens": False},  # exact unparsed
    ]
    for r, e in zip(rows, exacts):
        r["exact"] = None if e is None else {**e, "error": None}
    c = compare_exact("longvideobench", rows)
    assert c["compared"] == 4 and c["letter_pairs"] == 2
    assert c["letter_agreement"] == 0.5 and c["token_agreement"] == 0.5
    assert c["unparsed_pairs"] == {"total": 2, "mode_unparsed": 0, "exact_unparsed": 1,
                                   "both_unparsed": 1}
    rows[2]["exact"]["parsed_pred"] = None  # now no pair has two letters but the first
    rows[0]["parsed_pred"] = None
    c = compare_exact("longvideobench", rows)
    assert c["letter_pairs"] == 0 and c["letter_agreement"] is None
    assert c["unparsed_pairs"] == {"total": 4, "mode_unparsed": 1, "exact_unparsed": 2,
                                   "both_unparsed": 1}
    assert letters_agree("A", "A") is True and letters_agree("A", "B") is False
    assert letters_agree(None, None) is None and letters_agree("A", None) is None
    rows[0]["parsed_pred"] = "A"
    assert c["exact_scores"]["lvb_acc"] == pytest.approx(1 / 5)
    assert (c["exact_scores"]["errors"], c["exact_scores"]["unparsed"]) == (1, 3)


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
