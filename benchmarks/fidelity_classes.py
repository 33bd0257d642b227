"""Per-class answer fidelity: ``bench_fidelity.py --per-class N``.

For each class-balanced kind (:data:`KINDS`: the colour of the flash, of the most recent flash,
and whether there is a flash at all), the first ``N`` held-out videos of every answer (colour,
or yes / no) are drawn at each prompt length, so a colour the model misses shows up as its own
row instead of being averaged away. Every video is asked twice per variant: free-form (greedy,
the answer right when it is exactly the expected word) and with the closed vocabulary of its
kind (``Request.choices``: every answer the kind can have, scored by its exact log-probability;
right when the most probable choice is the expected one).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Any

from apbv.synthetic.needles import answer_choices, answer_of, patches_for_tokens

KINDS = ("retrieval", "recent", "presence")
MAX_INDEX = 4000
"""Held-out indices searched at most for a kind's samples (the rarest colour is 1 in 8)."""


def class_jobs(tokens: list[int], per_class: int, depths: list[float], seed: int,
               kinds: tuple[str, ...] = KINDS) -> list[dict[str, Any]]:
    """``per_class`` jobs per (kind, length, answer): the lowest held-out indices whose sample
    has that answer, the first needle at ``depths`` in turn (per answer)."""
    jobs = []
    for t in tokens:
        patches = patches_for_tokens(t)
        for kind in kinds:
            found: dict[str, list[int]] = {c: [] for c in answer_choices(kind)}
            for index in range(MAX_INDEX):
                if all(len(v) >= per_class for v in found.values()):
                    break
                # the answer is drawn before the needles' places: the same at every depth
                answer = answer_of(kind, patches=patches, seed=seed, index=index)
                picked = found[answer]
                if len(picked) < per_class:
                    jobs.append({"kind": kind, "tokens": t, "index": index,
                                 "depth": depths[len(picked) % len(depths)], "class": answer})
                    picked.append(index)
            short = {c: len(v) for c, v in found.items() if len(v) < per_class}
            assert not short, f"{kind}: too few held-out samples {short} in {MAX_INDEX}"
    return jobs


def free_answer(engine: Any, sample: Any, video: Any, mode: str, passing: int | None,
                max_new_tokens: int) -> Any:
    """The engine's free-form answer to ``sample``'s question about ``video`` in ``mode`` with
    the ``passing`` budget (None: the mode's)."""
    from apbv.engine.request import Request

    return engine.generate(Request(video=video, question=sample.question, mode=mode,
                                   max_new_tokens=max_new_tokens, passing_len=passing))


def rank_job(engine: Any, info: Any, jobs: list[dict], variants: list[str],
             variant_modes: dict[str, tuple[str, float | None]], make_sample: Any,
             passing_of: Any, max_new_tokens: int) -> list[dict]:
    """Answer every job in every variant, free-form and with choices; rows on every rank."""
    from apbv.engine.request import Request

    rows = []
    for n, job in enumerate(jobs):
        sample = make_sample(job)
        assert sample.answer == job["class"], (job, sample.answer)
        video = sample.video()
        for label in variants:
            mode, fraction = variant_modes[label]
            passing = passing_of(sample, fraction)
            free = free_answer(engine, sample, video, mode, passing, max_new_tokens)
            closed = engine.generate(Request(video=video, question=sample.question, mode=mode,
                                             passing_len=passing,
                                             choices=answer_choices(job["kind"])))
            probs = {c["text"]: float(c["prob"]) for c in closed.choices or ()}
            rows.append({**job, "variant": label, "mode": mode, "expected": sample.answer,
                         "answer": free.answer.strip(), "choice": closed.answer,
                         "correct": free.answer.strip() == sample.answer,
                         "choice_correct": closed.answer == sample.answer,
                         "prob_expected": probs.get(sample.answer),
                         "needles": [list(x) for x in sample.needles],
                         "prompt_tokens": free.context_len + free.query_len})
        if info.rank == 0:
            mine = rows[-len(variants):]
            marks = " ".join(f"{r['variant']}={r['answer']!r}/{r['choice']!r}" for r in mine)
            print(f"[bench] {n + 1}/{len(jobs)} {job['kind']} {job['tokens']}: expected "
                  f"{sample.answer!r}; {marks}", file=sys.stderr, flush=True)
    return rows


def summarise(rows: list[dict]) -> dict[tuple, dict[str, float]]:
    """(kind, tokens, class or "all", variant) -> free-form and choice accuracy, count."""
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        cells[(r["kind"], r["tokens"], r["class"], r["variant"])].append(r)
        cells[(r["kind"], r["tokens"], "all", r["variant"])].append(r)
    return {key: {"accuracy": sum(r["correct"] for r in group) / len(group),
                  "choice_accuracy": sum(r["choice_correct"] for r in group) / len(group),
                  "n": len(group),
                  "prompt_tokens": sum(r["prompt_tokens"] for r in group) / len(group)}
            for key, group in cells.items()}


def markdown(rows: list[dict], variants: list[str]) -> str:
    """One table per kind and length: a row per answer class, free-form / choice accuracy."""
    stats = summarise(rows)
    lines = ["Accuracy per answer class, free-form / with choices (the kind's closed "
             f"vocabulary); {len(rows) // max(1, len(variants))} videos, each answered by every "
             "variant both ways."]
    for kind in KINDS:
        for t in sorted({r["tokens"] for r in rows if r["kind"] == kind}):
            classes = [c for c in answer_choices(kind) if (kind, t, c, variants[0]) in stats]
            mean = stats[(kind, t, "all", variants[0])]["prompt_tokens"]
            lines += ["", f"{kind} ({mean:.0f} prompt tokens):", "",
                      "| answer | n | " + " | ".join(variants) + " |",
                      "|---|---:|" + "---|" * len(variants)]
            for c in (*classes, "all"):
                s = [stats[(kind, t, c, v)] for v in variants]
                lines.append(f"| {c} | {s[0]['n']} | " + " | ".join(
                    f"{x['accuracy']:.2f} / {x['choice_accuracy']:.2f}" for x in s) + " |")
    return "\n".join(lines)
