"""Scores from the harness's per-sample rows, and the lmms-eval-style results file.

A row is one finished sample (see :mod:`apbv.eval.harness`); what scoring reads of it: ``correct``
(False for an unparseable answer and for a sample that failed, e.g. a corrupt video: both are
wrong, never guessed), ``error``, ``parsed_pred``, the benchmark's fields, and ``exact`` when the
run compared against exact attention.

LongVideoBench (as lmms-eval aggregates ``lvb_acc``): accuracy over every row, and per
``duration_group`` and per ``question_category``. The denominator is every sample run, failed
ones included (the reference's ``N - too_short`` differs: spava-algorithm.md B12).

VNBench (VideoNIAH's ``evaluation/eval.py``): a question (one video and type, 4 option orders)
counts as right only if all 4 tries are right; accuracy per type over the questions whose 4
tries all ran (a run cut short by --limit leaves some incomplete: counted apart, not scored).
Overall is eval.py's: the unweighted mean of the per-type accuracies over the types present in
the run (``sum(acc) / len(acc)`` over the types it found). With all 9 types present that equals
the mean of the ret/ord/cnt means (3 types each); on a subset it does not: for ret_insert1,
cnt_edit1 and cnt_edit2 Overall is (a + b + c) / 3, not (a + (b + c) / 2) / 2. ret, ord and cnt
are each the mean of their types present (VideoNIAH's ``evaluation_utils.py`` divides by 3,
counting an absent type as 0; here an absent category is None). The type labels are the
annotation's own (the APB report swaps ret_insert1 and ret_insert2; VideoNIAH's scorer does not).

Agreement with exact attention (``compare="exact"``): letters agree when both answers parsed to
the same letter; a pair where either answer has no letter is counted apart as unparsed (two
unparsed answers are no agreement). Tokens agree when the token ids are equal.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from apbv.eval.data import TASK_NAMES, VNBENCH_CATEGORIES, VNBENCH_TRIES, vnbench_category

HEADLINE_METRICS = {
    "longvideobench": ("lvb_acc",),
    "vnbench": ("vnbench_acc", "vnbench_ret", "vnbench_ord", "vnbench_cnt"),
}
"""The metrics of the results file's ``results`` table: lmms-eval's ``lvb_acc``; for VNBench
the Overall accuracy and the three category means."""
DATASETS = {"longvideobench": ("longvideobench/LongVideoBench", "validation"),
            "vnbench": ("Joez1717/VNBench", "4try")}

Row = dict[str, Any]


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _tally(rows: Sequence[Row]) -> dict[str, Any]:
    return {
        "num": len(rows),
        "correct": sum(bool(r["correct"]) for r in rows),
        "acc": _mean([float(bool(r["correct"])) for r in rows]),
    }


def _counts(rows: Sequence[Row]) -> dict[str, int]:
    return {
        "errors": sum(r["error"] is not None for r in rows),
        "unparsed": sum(r["error"] is None and r["parsed_pred"] is None for r in rows),
    }


def longvideobench_scores(rows: Sequence[Row]) -> dict[str, Any]:
    """``lvb_acc`` and the per duration group and per question category breakdown."""
    by: dict[str, dict[str, list[Row]]] = {"duration_group": defaultdict(list),
                                           "question_category": defaultdict(list)}
    for r in rows:
        for key, groups in by.items():
            groups[str(r[key])].append(r)
    overall = _tally(rows)
    return {
        "lvb_acc": overall["acc"],
        **overall,
        **_counts(rows),
        **{key: {name: _tally(group) for name, group in sorted(groups.items())}
           for key, groups in by.items()},
    }


def vnbench_scores(rows: Sequence[Row]) -> dict[str, Any]:
    """Overall, ret/ord/cnt and per-type accuracy under the 4-try rule."""
    questions: dict[tuple[str, str], dict[int, bool]] = defaultdict(dict)
    for r in rows:
        questions[(r["video"], r["type"])][r["try"]] = bool(r["correct"])
    per_type: dict[str, list[bool]] = defaultdict(list)
    incomplete = 0
    for (_, task_type), tries in questions.items():
        if len(tries) < VNBENCH_TRIES:
            incomplete += 1
            continue
        per_type[task_type].append(all(tries.values()))
    types = {t: {"questions": len(v), "correct": sum(v), "acc": sum(v) / len(v)}
             for t, v in sorted(per_type.items())}
    categories = {c: _mean([s["acc"] for t, s in types.items() if vnbench_category(t) == c])
                  for c in VNBENCH_CATEGORIES}
    return {
        "vnbench_acc": _mean([s["acc"] for s in types.values()]),
        **{f"vnbench_{c}": a for c, a in categories.items()},
        "questions": sum(s["questions"] for s in types.values()),
        "incomplete_questions": incomplete,
        "types": types,
        "try_acc": _tally(rows)["acc"],
        "num": len(rows),
        **_counts(rows),
    }


def score_rows(bench: str, rows: Sequence[Row]) -> dict[str, Any]:
    """The benchmark's scores of ``rows`` (one per sample, each sample at most once)."""
    if bench == "longvideobench":
        return longvideobench_scores(rows)
    if bench == "vnbench":
        return vnbench_scores(rows)
    raise ValueError(f"unknown benchmark {bench!r}; allowed: {', '.join(HEADLINE_METRICS)}")


def letters_agree(mode_letter: str | None, exact_letter: str | None) -> bool | None:
    """Whether two parsed answers agree; None when either has no letter (not comparable)."""
    if mode_letter is None or exact_letter is None:
        return None
    return mode_letter == exact_letter


def _unparsed_pairs(compared: Sequence[Row]) -> dict[str, int]:
    """The pairs without a letter on one side or both."""
    mode = [r["parsed_pred"] is None for r in compared]
    exact = [r["exact"]["parsed_pred"] is None for r in compared]
    return {
        "total": sum(m or e for m, e in zip(mode, exact)),
        "mode_unparsed": sum(m and not e for m, e in zip(mode, exact)),
        "exact_unparsed": sum(e and not m for m, e in zip(mode, exact)),
        "both_unparsed": sum(m and e for m, e in zip(mode, exact)),
    }


def compare_exact(bench: str, rows: Sequence[Row]) -> dict[str, Any]:
    """Agreement of the mode's answers with exact attention's, over the rows where both ran:
    letters over the pairs where both parsed, the other pairs counted as unparsed; tokens over
    every pair. And exact attention's own scores (a failed sample stays wrong)."""
    compared = [r for r in rows if r["exact"] is not None and r["exact"]["error"] is None]
    both = [r for r in compared if r["parsed_pred"] is not None
            and r["exact"]["parsed_pred"] is not None]
    exact_rows = [{**r, **({"correct": False} if r["exact"] is None else
                           {k: r["exact"][k] for k in ("correct", "error", "parsed_pred")})}
                  for r in rows]
    return {
        "compared": len(compared),
        "letter_pairs": len(both),
        "letter_agreement": _mean([float(r["parsed_pred"] == r["exact"]["parsed_pred"])
                                   for r in both]),
        "unparsed_pairs": _unparsed_pairs(compared),
        "token_agreement": _mean([float(r["exact"]["same_tokens"]) for r in compared]),
        "exact_scores": score_rows(bench, exact_rows),
    }


def results_document(
    bench: str,
    rows: Sequence[Row],
    *,
    total: int,
    config: dict[str, Any],
    generation: dict[str, Any],
    compared: bool,
) -> dict[str, Any]:
    """The results file, shaped like lmms-eval's ``*_results.json``: ``results[task]`` holds
    ``"<metric>,none"`` (a fraction in [0, 1]) and ``"<metric>_stderr,none"``; ``n-samples``
    counts the benchmark's samples (``original``, ``total``: after --where, before --limit)
    and those scored (``effective``). Everything
    lmms-eval has no place for (the breakdowns, error counts, agreement with exact attention)
    is under ``apbv``."""
    task = TASK_NAMES[bench]
    metrics = HEADLINE_METRICS[bench]
    scores = score_rows(bench, rows)
    table: dict[str, Any] = {"alias": task}
    for m in metrics:
        table[f"{m},none"] = scores[m]
        table[f"{m}_stderr,none"] = "N/A"
    dataset, split = DATASETS[bench]
    details: dict[str, Any] = {"benchmark": bench, "scores": scores}
    if compared:
        details["compare_exact"] = compare_exact(bench, rows)
    return {
        "results": {task: table},
        "group_subtasks": {task: []},
        "configs": {task: {
            "task": task,
            "dataset_path": dataset,
            "test_split": split,
            "output_type": "generate_until",
            "generation_kwargs": generation,
            "metric_list": [{"metric": m, "higher_is_better": True} for m in metrics],
        }},
        "n-shot": {task: 0},
        "higher_is_better": {task: {m: True for m in metrics}},
        "n-samples": {task: {"original": total, "effective": len(rows)}},
        "config": config,
        "date": time.time(),
        "apbv": details,
    }
