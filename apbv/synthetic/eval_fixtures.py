"""Small offline datasets in the two benchmarks' own formats, with synthetic needle videos.

``make_eval_fixtures("longvideobench", DIR)`` writes ``DIR/lvb_val.json``, ``DIR/videos/*.mp4``
and ``DIR/subtitles/*.json``; ``make_eval_fixtures("vnbench", DIR)`` writes
``DIR/VNBench-main-4try.json`` and ``DIR/VNBench/*.mp4``. The annotation entries have the real
files' fields (see :mod:`apbv.eval.data`), so the harness runs on them exactly as on the
benchmarks.

The videos are :mod:`apbv.synthetic` test videos (a background colour per second and a moving
square) in which whole seconds are "needles": a large centred square of a named colour. The
questions ask about the needles (which colour comes first or last, which colour was inserted,
in which order, how many), so a real model can answer them; the tiny random test model cannot,
and the tests check the harness's mechanics instead. ``videos="needles"`` writes the trained
tiny model's needle videos and questions instead (:mod:`apbv.synthetic.eval_needles`).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

from apbv.eval.data import (
    BENCHMARKS,
    DEFAULT_ANNOTATION,
    VNBENCH_TRIES,
    VNBENCH_TYPES,
    vnbench_category,
)
from apbv.synthetic.videos import write_test_video

COLOURS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220),
    "yellow": (235, 210, 40), "white": (245, 245, 245), "black": (15, 15, 15),
}
SECONDS = 8
FPS = 4.0
SIZE = 112
VIDEO_STYLES = ("squares", "needles")
"""What the videos show: moving squares with square needles, or the tiny model's needles."""
NEEDLE_COUNTS = {"longvideobench": 24, "vnbench": 6}
"""Default ``count`` of the needle fixtures."""
Needles = list[tuple[int, str]]
"""(second, colour name) pairs: that second of the video shows the colour's needle."""


def _video(path: Path, needles: Needles, seed: int) -> None:
    """A SECONDS-long test video with the needles: second ``t`` of each ``(t, name)`` shows a
    large ``name``-coloured square."""
    frames = {}
    per_second = round(FPS)
    for second, name in needles:
        for i in range(second * per_second, (second + 1) * per_second):
            frames[i] = COLOURS[name]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_test_video(path, num_frames=SECONDS * per_second, fps=FPS, width=SIZE, height=SIZE,
                     seed=seed, needles=frames)


def _write_json(path: Path, entries: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps(entries, indent=1) + "\n", encoding="utf-8")
    return path


def _longvideobench(out: Path, count: int, rng: random.Random) -> Path:
    entries = []
    for v in range((count + 1) // 2):
        video_id = f"lvbfix{v:03d}"
        first, last = rng.sample(sorted(COLOURS), 2)
        _video(out / "videos" / f"{video_id}.mp4", [(1, first), (SECONDS - 2, last)], seed=v)
        (out / "subtitles").mkdir(parents=True, exist_ok=True)
        _write_json(out / "subtitles" / f"{video_id}_en.json",
                    [{"timestamp": [0.0, 2.0], "text": "A square appears."},
                     {"timestamp": [5.0, float(SECONDS)], "text": "Another one."}])
        questions = [(first, "first", "T2O"), (last, "last", "T3O")]
        for k, (answer, which, category) in enumerate(questions[:count - 2 * v]):
            options = 4 + k  # 4 and 5 candidates: letters A-D and A-E
            candidates = rng.sample([c for c in sorted(COLOURS) if c != answer], options - 1)
            correct = rng.randrange(options)
            candidates.insert(correct, answer)
            entries.append({
                "video_id": video_id,
                "question": f"What colour is the large square shown {which} in the video?",
                "candidates": candidates,
                "correct_choice": correct,
                "question_category": category,
                "id": f"{video_id}_{k}",
                "video_path": f"{video_id}.mp4",
                "subtitle_path": f"{video_id}_en.json",
                "duration_group": 15,
                "starting_timestamp_for_subtitles": 0,
                "duration": float(SECONDS),
            })
    return _write_json(out / DEFAULT_ANNOTATION["longvideobench"], entries)


def _vnbench_question(category: str,
                      rng: random.Random) -> tuple[Needles, str, list[Any], Any]:
    """(needles, question, options in a base order, gt) for one VNBench category."""
    seconds = [1, 3, 5, 7]
    if category == "ret":
        colour = rng.choice(sorted(COLOURS))
        others = rng.sample([c for c in sorted(COLOURS) if c != colour], 3)
        return ([(rng.choice(seconds), colour)],
                "What colour is the large square inserted into the video?",
                rng.sample([colour, *others], 4), colour)
    if category == "ord":
        order = rng.sample(sorted(COLOURS), 4)
        options = {", ".join(order)}
        while len(options) < 4:
            options.add(", ".join(rng.sample(order, 4)))
        return (list(zip(seconds, order)),
                "What is the order of the colours of the large squares inserted into the video?",
                rng.sample(sorted(options), 4), ", ".join(order))
    count = rng.randint(1, 4)
    colour = rng.choice(sorted(COLOURS))
    return ([(s, colour) for s in sorted(rng.sample(seconds, count))],
            f"How many large {colour} squares appeared in the video?",
            rng.sample([1, 2, 3, 4], 4), count)


def _vnbench(out: Path, count: int, types: tuple[str, ...], rng: random.Random) -> Path:
    entries: list[dict[str, Any]] = []
    for task_type in types:
        for q in range(count):
            video = f"./VNBench/vnfix{q:03d}_{task_type}.mp4"
            needles, question, options, gt = _vnbench_question(vnbench_category(task_type), rng)
            _video(out / video, needles, seed=len(entries))
            for t in range(VNBENCH_TRIES):
                order = options[t:] + options[:t]  # the answer takes 4 different letters
                entries.append({
                    "video": video,
                    "question": question,
                    "options": order,
                    "needle_time": [s for s, _ in needles],
                    "gt": gt,
                    "gt_option": "ABCD"[order.index(gt)],
                    "length": float(SECONDS),
                    "type": task_type,
                    "try": t,
                })
    return _write_json(out / DEFAULT_ANNOTATION["vnbench"], entries)


def make_eval_fixtures(
    bench: str,
    out: str | os.PathLike[str],
    *,
    count: int | None = None,
    types: tuple[str, ...] | None = None,
    seed: int = 0,
    videos: str = "squares",
) -> Path:
    """Write a small dataset of ``bench`` under ``out``; returns its annotation file.

    ``count``: LongVideoBench questions (default 4; two per video), or VNBench questions per
    type (default 1; each 4 tries). ``types``: the VNBench types to write (default: all;
    with needles :data:`apbv.synthetic.eval_needles.NEEDLE_TYPES`). ``videos``: one of
    :data:`VIDEO_STYLES` (needles: default counts :data:`NEEDLE_COUNTS`).
    """
    if bench not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {bench!r}; allowed: {', '.join(BENCHMARKS)}")
    if videos not in VIDEO_STYLES:
        raise ValueError(f"unknown fixture videos {videos!r}; allowed: {', '.join(VIDEO_STYLES)}")
    if count is None:
        count = NEEDLE_COUNTS[bench] if videos == "needles" else \
            4 if bench == "longvideobench" else 1
    if types is None:
        from apbv.synthetic.eval_needles import NEEDLE_TYPES

        types = NEEDLE_TYPES if videos == "needles" else VNBENCH_TYPES
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be an integer >= 1, got {count!r}")
    for task_type in types:
        vnbench_category(task_type)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if videos == "needles":
        from apbv.synthetic.eval_needles import longvideobench_needles, vnbench_needles

        if bench == "longvideobench":
            return longvideobench_needles(out, count, seed)
        return vnbench_needles(out, count, tuple(types), seed)
    rng = random.Random(seed)
    if bench == "longvideobench":
        return _longvideobench(out, count, rng)
    return _vnbench(out, count, tuple(types), rng)
