"""Multiple-choice needle questions in the two benchmarks' prompt formats (pure, seeded).

A needle sample of :mod:`apbv.synthetic.needles` asks a free-form question ("What colour is
the flash?") and is answered with a word. Here the same video is asked as LongVideoBench or
VNBench would ask it: the question, its options one per line with their letters, and the
benchmark's instruction, exactly the text :func:`apbv.eval.data.choice_prompt` (the harness's
own prompt builder) writes; the answer is the right option's letter.

Options per kind (the right one at a random place, the others drawn from the kind's answers):

- ``retrieval``, ``ordering``, ``recent``: colour names; 4 options for VNBench, 4 or 5 for
  LongVideoBench (its questions have up to 5 candidates);
- ``counting``: the numbers 1 .. ``MAX_COUNT`` in a random order (VNBench's counting options
  are numbers; both formats write them as digits);
- ``presence``: ``yes`` and ``no`` in a random order (2 options; LongVideoBench only: every
  VNBench question has 4).

A sample is a pure function of ``(bench, kind, seed, index, patches, depth)``; its video is
:func:`apbv.synthetic.needles.make_sample`'s with the same arguments.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from apbv.eval.data import BENCHMARKS, INSTRUCTION, choice_prompt
from apbv.eval.parse import option_letters
from apbv.synthetic.needles import (
    KINDS,
    QUESTIONS,
    NeedleSample,
    answer_choices,
    make_sample,
)

CHOICE_KINDS = {
    "vnbench": ("retrieval", "ordering", "counting"),
    "longvideobench": ("retrieval", "ordering", "counting", "presence", "recent"),
}
"""The needle kinds each benchmark format asks (VNBench's three categories; every VNBench
question has 4 options, so presence with its 2 answers is LongVideoBench's only)."""


def _check(bench: str, kind: str) -> None:
    if bench not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {bench!r}; allowed: {', '.join(BENCHMARKS)}")
    if kind not in CHOICE_KINDS[bench]:
        raise ValueError(f"{bench} asks no {kind!r} question; allowed: "
                         f"{', '.join(CHOICE_KINDS[bench])}")


def choice_options(bench: str, kind: str, answer: str, rng: np.random.Generator) -> list[str]:
    """The options of a ``kind`` question in ``bench``'s format whose right answer is
    ``answer``: the right one at a random place among others of the kind's answers."""
    _check(bench, kind)
    pool = list(answer_choices(kind))
    if answer not in pool:
        raise ValueError(f"{answer!r} is no {kind} answer; allowed: {', '.join(pool)}")
    if kind in ("counting", "presence"):
        count = len(pool)
    else:
        count = 4 if bench == "vnbench" else 4 + int(rng.integers(2))
    others = [pool[i] for i in rng.permutation(len(pool)) if pool[i] != answer][:count - 1]
    options = list(others)
    options.insert(int(rng.integers(count)), answer)
    return options


def choice_sample(bench: str, kind: str, *, patches: int, seed: int, index: int,
                  depth: float | None = None) -> NeedleSample:
    """:func:`~apbv.synthetic.needles.make_sample`'s video asked as a ``bench``
    multiple-choice question: ``question`` is the harness's whole user text (question,
    lettered options, instruction), ``answer`` the right option's letter."""
    _check(bench, kind)
    sample = make_sample(kind, patches=patches, seed=seed, index=index, depth=depth)
    rng = np.random.default_rng([seed, KINDS.index(kind), index, patches,
                                 1 + BENCHMARKS.index(bench)])
    options = choice_options(bench, kind, sample.answer, rng)
    letter = option_letters(len(options))[options.index(sample.answer)]
    return dataclasses.replace(sample, question=choice_prompt(bench, QUESTIONS[kind], options),
                               answer=letter)


def options_sample(bench: str, kind: str, *, patches: int, seed: int, index: int,
                   depth: float | None = None) -> NeedleSample:
    """:func:`choice_sample`'s video, question and lettered options without the benchmark's
    instruction line, answered with the right option's text (the free-form word). Trained
    beside the letters, it teaches the model to read the video under a list of options (the
    first step of a letter answer: the flash's colour, then its option's letter)."""
    sample = choice_sample(bench, kind, patches=patches, seed=seed, index=index, depth=depth)
    lead, found, _ = sample.question.rpartition("\n" + INSTRUCTION)
    assert found, sample.question
    return dataclasses.replace(sample, question=lead, answer=_option_text(sample))


def named_sample(bench: str, kind: str, *, patches: int, seed: int, index: int,
                 depth: float | None = None) -> NeedleSample:
    """:func:`choice_sample`'s video and whole question (the harness's text), answered with
    the right option's text and then its letter, ``green (B)``: the word read from the video
    first, then the letter looked up beside that word in the options; the harness's parser
    (:func:`apbv.eval.parse.parse_choice`: the first standalone capital letter) reads B."""
    sample = choice_sample(bench, kind, patches=patches, seed=seed, index=index, depth=depth)
    return dataclasses.replace(sample, answer=f"{_option_text(sample)} ({sample.answer})")


def _option_text(sample: NeedleSample) -> str:
    """The text of the option whose letter is ``sample.answer`` (a :func:`choice_sample`)."""
    return next(line[3:] for line in sample.question.split("\n")
                if line.startswith(sample.answer + ". "))
