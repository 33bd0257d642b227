"""What the tiny model is trained on, step by step, and the held-out sets beside the old ones.

The trainer (:mod:`apbv.synthetic.train_tiny`) takes its step's task from the schedule of its
``mix`` (:data:`MIXES`), in turn: ``needles`` (the default: the five free-form kinds, the recipe
of the shipped checkpoint) or ``choice-camera`` (:data:`SCHEDULE`, with multiple-choice and
static-camera entries; its continuation of the shipped checkpoint regressed and was not
shipped: docs/tiny_model.md) or ``letters`` (:data:`LETTERS`: free-form, option texts and
the needle fixtures' letters, for a grown checkpoint) or ``named`` (:data:`NAMED`: free-form
and the fixtures' questions answered ``green (B)``) or ``joint`` (:data:`JOINT`: those two
and a text-only lookup step in turn). An entry is one of:

- ``free/KIND``: a :mod:`apbv.synthetic.needles` question answered with a word (the
  original five kinds);
- ``choice/BENCH/KIND``: the same video asked as a multiple-choice question in the
  benchmark's prompt format (:mod:`apbv.synthetic.choices`: exactly the harness's text),
  answered with the option letter;
- ``options/BENCH/KIND``: the same question and options without the benchmark's
  instruction line, answered with the right option's text
  (:func:`apbv.synthetic.choices.options_sample`);
- ``named/BENCH/KIND``: the ``choice/`` question answered with the right option's text and
  then its letter, ``green (B)`` (:func:`apbv.synthetic.choices.named_sample`);
- ``lookup``: no video, a batch of text-only letter lookups
  (:func:`apbv.synthetic.lookup.lookup_batch`);
- ``camera/EVENT`` and ``camera/EVENT/pruned``: a static-camera video
  (:mod:`apbv.synthetic.camera`) asked the event's colour, the second with its temporal
  patches pruned as the engine prunes them at ``video.static_threshold`` (a threshold drawn
  from :data:`TRAIN_THRESHOLDS` per sample; the first patch and the changed ones stay, at
  their positions in the whole video).

``free`` entries follow the trainer's length curriculum; the others are capped at
:data:`LENGTH_CAPS` temporal patches (their held-out and benchmark videos are short). Every
sample is a pure function of its entry, seed, index and length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

import numpy as np

from apbv.eval.data import BENCHMARKS
from apbv.synthetic.camera import CAMERA_KINDS, camera_sample
from apbv.synthetic.choices import CHOICE_KINDS, choice_sample, named_sample, options_sample
from apbv.synthetic.needles import KINDS, NeedleSample, make_sample

SCHEDULE = (
    "free/retrieval", "choice/vnbench/retrieval", "camera/flash", "free/presence",
    "choice/longvideobench/retrieval", "camera/object/pruned", "free/recent",
    "choice/vnbench/counting", "camera/object", "free/counting",
    "choice/longvideobench/presence", "camera/flash/pruned", "free/retrieval",
    "choice/vnbench/retrieval", "camera/object/pruned", "free/presence",
    "choice/longvideobench/counting", "camera/object", "free/ordering",
    "choice/longvideobench/retrieval",
)
"""Task of each step, in turn (20): the five free-form kinds 7 times (retrieval and presence 2
each), multiple-choice 7 (retrieval 4, counting 2, presence 1), static camera 6 (objects 4,
flashes 2; 3 of them pruned)."""
NEEDLES = ("free/retrieval", "free/presence", "free/recent", "free/retrieval", "free/counting",
           "free/retrieval", "free/presence", "free/recent", "free/retrieval", "free/ordering")
"""The free-form kinds in turn (10): retrieval 4, presence and recent 2 each, counting and
ordering 1 each."""
_LETTER_CHOICES = ("choice/vnbench/retrieval", "choice/longvideobench/presence",
                   "choice/vnbench/counting", "choice/longvideobench/retrieval",
                   "choice/vnbench/retrieval", "choice/longvideobench/counting",
                   "choice/vnbench/counting", "choice/longvideobench/presence",
                   "choice/vnbench/retrieval", "choice/longvideobench/retrieval")
LETTERS = tuple(e for free, choice in zip(NEEDLES, _LETTER_CHOICES)
                for e in (free, "options/" + choice.split("/", 1)[1], choice))
"""Free-form (:data:`NEEDLES`), the same option lists answered with the option's text
(``options/``, no instruction line) and the letters the needle fixtures ask, in turn (30; one
step each, so that no run of steps teaches one format alone). Letters and option texts:
VNBench retrieval 3, counting 2; LongVideoBench retrieval 2, counting 1, presence 2."""
_CAMERA = ("camera/object", "camera/flash/pruned", "camera/object/pruned", "camera/object",
           "camera/flash", "camera/object/pruned", "camera/object", "camera/flash/pruned",
           "camera/object/pruned", "camera/flash")
CAMERA = tuple(e for pair in zip(NEEDLES, _CAMERA) for e in pair)
"""Free-form (:data:`NEEDLES`) and static-camera videos in turn (20): moving objects 6 (3
pruned), flashes 4 (2 pruned); no multiple-choice steps (they leaked letters into free-form
answers)."""
CAMERA_SETTLE = ("free/retrieval", "free/presence", "camera/object", "free/recent",
                 "free/retrieval", "camera/flash/pruned", "free/counting", "free/retrieval",
                 "camera/object/pruned", "free/presence", "free/recent", "camera/flash",
                 "free/retrieval", "free/ordering", "camera/object")
"""The same kinds, free-form and camera two to one (15), for a continuation of a ``camera``
checkpoint at a lower rate (:data:`FINE_TUNE_OVERRIDES`)."""
LOOKUP = "lookup"
"""A text-only step: :func:`apbv.synthetic.lookup.lookup_batch` (no video)."""
_NAMED_CHOICES = tuple("named" + e[len("choice"):] for e in _LETTER_CHOICES)
NAMED = tuple(e for pair in zip(NEEDLES, _NAMED_CHOICES) for e in pair)
"""Free-form (:data:`NEEDLES`) and the needle fixtures' questions answered ``green (B)``
(``named/``: the word, then its option's letter) in turn (20), for a checkpoint that has
learned the letter lookup on text (``benchmarks/letter_lookup.py --save``)."""
JOINT = tuple(e for free, named in zip(NEEDLES, _NAMED_CHOICES) for e in (free, LOOKUP, named))
"""Free-form, a text-only lookup step and a ``named/`` question in turn (30): the lookup
learned beside the video reading, not before it (text alone erases the video:
docs/tiny_model.md)."""
MIXES = {"needles": NEEDLES, "choice-camera": SCHEDULE, "letters": LETTERS, "camera": CAMERA,
         "camera-settle": CAMERA_SETTLE, "named": NAMED, "joint": JOINT}
FINE_TUNE_OVERRIDES: dict[str, dict[str, object]] = {
    "needles": {},
    "choice-camera": {"steps": 1400,
                      "curriculum": ((0.0, 64), (0.2, 256), (0.5, 1024), (0.8, 2048))},
    "camera": {"steps": 2400},
    "camera-settle": {"steps": 1000, "lr": 3e-4},
    "named": {"steps": 1200, "lr": 5e-4,
              "curriculum": ((0.0, 64), (0.3, 256), (0.6, 1024), (0.8, 2048))},
    "joint": {"steps": 2100, "lr": 3e-3,
              "curriculum": ((0.0, 256), (0.3, 1024), (0.6, 2048))},
    "letters": {"steps": 2400, "lr": 2e-3, "grow": 3, "old_lr_scale": 0.5,
                "curriculum": ((0.0, 32), (0.5, 128), (0.85, 512))},
}
"""Per mix, what ``--init`` changes of :data:`apbv.synthetic.train_tiny.FINE_TUNE`."""
LENGTH_CAPS = {"choice": 512, "options": 512, "named": 512, "camera": 256}
CHOICE_MAKERS = {"choice": choice_sample, "options": options_sample, "named": named_sample}
"""The sample of each multiple-choice entry form, by its first part."""
"""Longest video (temporal patches) of the non-free entries."""
TRAIN_THRESHOLDS = (2.0, 4.0, 8.0, 16.0)
"""``video.static_threshold`` values (levels) a pruned training sample is pruned at."""


@dataclass(frozen=True)
class Task:
    sample: NeedleSample
    threshold: float | None
    """Temporal pruning threshold of its input (None: every patch)."""


def check_entry(entry: str) -> None:
    """ValueError naming the allowed forms unless ``entry`` is a valid schedule entry."""
    parts = entry.split("/")
    ok = entry == LOOKUP or (parts[0] == "free" and len(parts) == 2 and parts[1] in KINDS) or \
        (parts[0] in CHOICE_MAKERS and len(parts) == 3 and parts[1] in BENCHMARKS
         and parts[2] in CHOICE_KINDS[parts[1]]) or \
        (parts[0] == "camera" and len(parts) in (2, 3) and parts[1] in CAMERA_KINDS
         and parts[2:] in ([], ["pruned"]))
    if not ok:
        raise ValueError(f"schedule entry {entry!r} must be free/KIND, choice/BENCH/KIND, "
                         f"options/BENCH/KIND, named/BENCH/KIND, {LOOKUP} or "
                         f"camera/EVENT[/pruned] (KIND: {', '.join(KINDS)}; BENCH: "
                         f"{', '.join(BENCHMARKS)}; EVENT: {', '.join(CAMERA_KINDS)})")


def schedule(name: str) -> tuple[str, ...]:
    """The schedule of mix ``name``; ValueError naming the mixes."""
    if name not in MIXES:
        raise ValueError(f"unknown training mix {name!r}; allowed: {', '.join(MIXES)}")
    return MIXES[name]


def longest_for(entry: str, longest: int) -> int:
    """The longest video of ``entry`` when the curriculum allows ``longest`` patches."""
    return min(longest, LENGTH_CAPS.get(entry.split("/")[0], longest))


def make_task(entry: str, *, patches: int, seed: int, index: int,
              depth: float | None = None) -> Task:
    """Sample ``index`` of schedule ``entry`` with ``patches`` temporal patches."""
    check_entry(entry)
    assert entry != LOOKUP, "a lookup step has no video task (apbv.synthetic.lookup)"
    parts = entry.split("/")
    if parts[0] == "free":
        return Task(make_sample(parts[1], patches=patches, seed=seed, index=index,
                                depth=depth), None)
    if parts[0] in CHOICE_MAKERS:
        return Task(CHOICE_MAKERS[parts[0]](parts[1], parts[2], patches=patches, seed=seed,
                                            index=index, depth=depth), None)
    sample = camera_sample(parts[1], patches=patches, seed=seed, index=index)
    if parts[2:] != ["pruned"]:
        return Task(sample, None)
    rng = np.random.default_rng([seed, index, patches, 7])
    return Task(sample, TRAIN_THRESHOLDS[int(rng.integers(len(TRAIN_THRESHOLDS)))])


HELDOUT_SETS = {
    "choice/vnbench/retrieval": (128, 512), "choice/vnbench/counting": (128, 512),
    "choice/longvideobench/retrieval": (128, 512), "choice/longvideobench/counting": (128, 512),
    "choice/longvideobench/presence": (128, 512),
    "camera/flash": (128,), "camera/object": (128,),
}
"""Held-out sets beside the free-form kinds': entry -> video lengths (temporal patches).
Camera sets are also asked pruned at :data:`HELDOUT_THRESHOLD`."""
HELDOUT_THRESHOLD = 8.0


def heldout_tasks(entry: str, patches: int, samples: int, seed: int, pruned: bool
                  ) -> list[Task]:
    """The held-out tasks of one cell (pruned: camera videos at :data:`HELDOUT_THRESHOLD`)."""
    tasks = [make_task(entry, patches=patches, seed=seed, index=i) for i in range(samples)]
    if pruned:
        tasks = [Task(t.sample, HELDOUT_THRESHOLD) for t in tasks]
    return tasks


def answer_form(name: str) -> str:
    """How mix ``name`` answers the multiple-choice sets: ``named`` (``green (B)``) where it
    trains ``named/`` entries, ``choice`` (the letter) otherwise."""
    return "named" if any(e.startswith("named/") for e in schedule(name)) else "choice"


def as_form(entry: str, form: str) -> str:
    """``entry`` with a ``choice/`` prefix asked in answer ``form`` instead."""
    return form + entry[len("choice"):] if entry.startswith("choice/") else entry


def heldout_accuracy(answers: Callable[[Task], bool], samples: int, seed: int,
                     longest: int, progress: TextIO | None = None, form: str = "choice"
                     ) -> dict[str, dict[str, float]]:
    """{set: {patches: accuracy}} over :data:`HELDOUT_SETS` (camera sets also pruned at
    :data:`HELDOUT_THRESHOLD`, named ``camera/EVENT/pruned``; lengths capped at ``longest``
    patches; multiple-choice sets asked in answer ``form``), ``answers(task)`` telling
    whether the model answers a task right."""
    result: dict[str, dict[str, float]] = {}
    for entry, lengths in ((as_form(e, form), n) for e, n in HELDOUT_SETS.items()):
        for pruned in (False, True) if entry.startswith("camera/") else (False,):
            name = entry + "/pruned" * pruned
            result[name] = {}
            for patches in sorted({min(n, longest) for n in lengths}):
                tasks = heldout_tasks(entry, patches, samples, seed, pruned)
                right = sum(answers(t) for t in tasks)
                result[name][str(patches)] = right / len(tasks)
                if progress:
                    print(f"held-out {name} @ {patches} patches: {right / len(tasks):.2f}",
                          file=progress, flush=True)
    return result
