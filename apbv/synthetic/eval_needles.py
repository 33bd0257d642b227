"""Benchmark-format fixtures whose videos are the trained tiny model's needle videos.

``make_eval_fixtures(bench, DIR, videos="needles")`` (``make-eval-fixtures --videos needles``)
writes the same files as the square fixtures (:mod:`apbv.synthetic.eval_fixtures`), but each
video is a :mod:`apbv.synthetic.needles` video (56 x 56 noise frames at 2 fps with coloured flashes,
encoded nearly losslessly) and each question is that video's needle question with lettered
options (:mod:`apbv.synthetic.choices`), so the shipped model ``apbv/assets/needle-tiny``
answers them with a letter. Videos are 32, 64, 128 and 256 temporal patches (seconds) long in
turn, from a seed no training or held-out set uses.

- LongVideoBench: ``count`` questions, the kinds :data:`LVB_KINDS` in turn (category: the
  kind), one video each;
- VNBench: ``count`` questions per type (ret -> retrieval, cnt -> counting, ord -> ordering),
  each asked in 4 tries whose options are rotated, so the answer takes 4 different letters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from apbv.eval.data import DEFAULT_ANNOTATION, VNBENCH_TRIES, vnbench_category
from apbv.eval.parse import option_letters
from apbv.synthetic.choices import choice_options
from apbv.synthetic.needle_video import write_frames
from apbv.synthetic.needles import FPS, QUESTIONS, make_sample

FIXTURE_SEED = 5_000_011
"""Added to the fixture's seed: the trainer draws from seeds 0 and 1000003."""
LENGTHS = (32, 64, 128, 256)
"""Temporal patches of the videos, in turn (2 frames each at 2 fps: as many seconds)."""
LVB_KINDS = ("retrieval", "counting", "presence")
"""The needle kinds the LongVideoBench fixture asks, in turn (the ones the model learned)."""
NEEDLE_TYPES = ("ret_insert1", "cnt_insert1")
"""The VNBench fixture's default types (ordering, ``ord_*``, is asked when named)."""
CATEGORY_KINDS = {"ret": "retrieval", "cnt": "counting", "ord": "ordering"}


def _write(path: Path, entries: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps(entries, indent=1) + "\n", encoding="utf-8")
    return path


def _question(kind: str, bench: str, index: int, seed: int) -> tuple[Any, list[str], int]:
    """(needle sample, options, index of the right one) of fixture question ``index``."""
    patches = LENGTHS[index % len(LENGTHS)]
    sample = make_sample(kind, patches=patches, seed=FIXTURE_SEED + seed, index=index)
    rng = np.random.default_rng([FIXTURE_SEED + seed, index, patches, len(kind)])
    options = choice_options(bench, kind, sample.answer, rng)
    return sample, options, options.index(sample.answer)


def longvideobench_needles(out: Path, count: int, seed: int) -> Path:
    """``count`` LongVideoBench-format needle questions under ``out``; the annotation file."""
    entries = []
    for q in range(count):
        kind = LVB_KINDS[q % len(LVB_KINDS)]
        sample, options, right = _question(kind, "longvideobench", q, seed)
        video_id = f"lvbneedle{q:03d}"
        write_frames(out / "videos" / f"{video_id}.mp4", sample.frames)
        seconds = sample.frames.shape[0] / FPS
        entries.append({
            "video_id": video_id, "question": QUESTIONS[kind], "candidates": options,
            "correct_choice": right, "question_category": kind, "id": f"{video_id}_0",
            "video_path": f"{video_id}.mp4", "duration_group": 60 if seconds <= 60 else 600,
            "duration": seconds,
        })
    return _write(out / DEFAULT_ANNOTATION["longvideobench"], entries)


def vnbench_needles(out: Path, count: int, types: tuple[str, ...], seed: int) -> Path:
    """``count`` VNBench-format needle questions per type under ``out``, 4 tries each; the
    annotation file."""
    entries = []
    for t_index, task_type in enumerate(types):
        kind = CATEGORY_KINDS[vnbench_category(task_type)]
        for q in range(count):
            sample, options, _ = _question(kind, "vnbench", t_index * count + q, seed)
            video = f"./VNBench/vnneedle{q:03d}_{task_type}.mp4"
            write_frames(out / video, sample.frames)
            letters = option_letters(len(options))
            for attempt in range(VNBENCH_TRIES):
                order = options[attempt:] + options[:attempt]
                gt: Any = int(sample.answer) if kind == "counting" else sample.answer
                entries.append({
                    "video": video, "question": QUESTIONS[kind],
                    "options": [int(o) for o in order] if kind == "counting" else order,
                    "needle_time": [p * 2 / FPS for p, _ in sample.needles], "gt": gt,
                    "gt_option": letters[order.index(sample.answer)],
                    "length": sample.frames.shape[0] / FPS, "type": task_type, "try": attempt,
                })
    return _write(out / DEFAULT_ANNOTATION["vnbench"], entries)
