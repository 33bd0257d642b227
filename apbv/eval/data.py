"""The two benchmarks' own annotation files, read from a local directory, and their prompts.

LongVideoBench (validation split, as released on the HF hub ``longvideobench/LongVideoBench``)::

    DIR/lvb_val.json      [{"id", "video_path", "question", "candidates": [...],
                            "correct_choice": int, "duration_group", "question_category",
                            "duration", "subtitle_path", ...}, ...]
    DIR/videos/<video_path>

  ``candidates`` may instead be lmms-eval's ``option0``..``option4`` ("N/A" when unused). The
  test split hides ``correct_choice`` and cannot be scored here. Prompt (one text block after the
  video; LongVideoBench's own text items, one per line)::

    Question: {question}
    A. {candidate 0}
    B. {candidate 1}
    ...
    Answer with the option's letter from the given choices directly.

  This is lmms-eval's ``longvideobench_val_v`` prompt (video file, no subtitles, question and
  options joined by newlines) with LongVideoBench's "Question: " prefix. The APB reference
  concatenates the same items with no separator at all; subtitles are not used.

VNBench (the 4-try annotation ``VNBench-main-4try.json``, 1350 questions x 4 option orders)::

    DIR/VNBench-main-4try.json   [{"video": "./VNBench/x.mp4", "question", "options": [4],
                                   "gt", "gt_option": "A".."D", "type", "try": 0..3,
                                   "needle_time", "length"}, ...]
    DIR/VNBench/x.mp4            (``video`` is resolved against DIR when relative)

  ``options`` and ``gt`` are strings or, for counting, integers; ``gt_option`` is the letter of
  ``gt`` (derived from ``options.index(gt)`` when absent). A ``.jsonl`` file is read line by
  line. Prompt (VideoNIAH's)::

    {question}
    A. {option 0}
    B. {option 1}
    C. {option 2}
    D. {option 3}
    Answer with the option's letter from the given choices directly.

  Sample id: ``{video file stem}_{type}_{try}``, the ``question_id`` form of VideoNIAH's
  ``evaluation/eval.py`` (dropping the last 2 characters gives the question).

Every sample gets the same frame sampling, from the engine's video config, whatever the mode.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apbv.eval.parse import option_letters

BENCHMARKS = ("longvideobench", "vnbench")
DEFAULT_ANNOTATION = {"longvideobench": "lvb_val.json", "vnbench": "VNBench-main-4try.json"}
TASK_NAMES = {"longvideobench": "longvideobench_val_v", "vnbench": "vnbench"}
"""Result names: lmms-eval's task name for LongVideoBench; VNBench is no lmms-eval task."""
DEFAULT_MAX_NEW_TOKENS = {"longvideobench": 32, "vnbench": 5}
"""lmms-eval's generation_kwargs for longvideobench_val_v; the VNBench runners' value."""
INSTRUCTION = "Answer with the option's letter from the given choices directly."
VNBENCH_CATEGORIES = ("ret", "ord", "cnt")
VNBENCH_TYPES = ("ret_insert1", "ret_insert2", "ret_edit1", "ord_insert1", "ord_insert2",
                 "ord_edit1", "cnt_insert1", "cnt_edit1", "cnt_edit2")
VNBENCH_TRIES = 4


@dataclass(frozen=True)
class Sample:
    """One question of a benchmark, ready for the engine."""

    id: str
    video: str
    """The video as the annotation names it."""
    video_path: str
    """The local file to decode."""
    prompt: str
    """The whole user text after the video."""
    letters: str
    """The option letters, e.g. "ABCD"."""
    gt: str
    """The correct option's letter."""
    fields: dict[str, Any] = field(default_factory=dict)
    """The benchmark's own per-sample fields copied into the output row (categories, try)."""


def _check_bench(bench: str) -> None:
    if bench not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {bench!r}; allowed: {', '.join(BENCHMARKS)}")


def annotation_path(bench: str, data_dir: str | os.PathLike[str],
                    annotation: str | None = None) -> Path:
    """The annotation file: ``annotation`` (a path, or a name inside ``data_dir``) or the
    benchmark's default name inside ``data_dir``."""
    _check_bench(bench)
    return Path(data_dir) / (annotation or DEFAULT_ANNOTATION[bench])


def _read_entries(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ValueError(f"annotation file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".jsonl":
            entries = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            entries = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"annotation file {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"annotation file {str(path)!r} must hold a list of objects")
    if not entries:
        raise ValueError(f"annotation file {str(path)!r} has no entries")
    return entries


def _require(entry: dict[str, Any], index: int, keys: tuple[str, ...], path: Path) -> None:
    missing = [k for k in keys if k not in entry]
    if missing:
        raise ValueError(f"{path.name} entry {index} lacks {', '.join(missing)}")


def _options_prompt(lead: str, options: list[Any], letters: str) -> str:
    lines = [lead] + [f"{letter}. {option}" for letter, option in zip(letters, options)]
    return "\n".join(lines + [INSTRUCTION])


def _longvideobench(entries: list[dict[str, Any]], data_dir: Path, path: Path) -> list[Sample]:
    samples = []
    for i, e in enumerate(entries):
        _require(e, i, ("id", "video_path", "question", "duration_group",
                        "question_category"), path)
        if "candidates" in e:
            options = e["candidates"]
            if not isinstance(options, list):
                raise ValueError(f"{path.name} entry {i}: candidates must be a list")
        else:
            options = [e[k] for k in (f"option{j}" for j in range(5)) if e.get(k, "N/A") != "N/A"]
        letters = option_letters(len(options))
        choice = e.get("correct_choice")
        if isinstance(choice, bool) or not isinstance(choice, int) or \
                not 0 <= choice < len(options):
            raise ValueError(f"{path.name} entry {i} ({e['id']}): correct_choice must be an "
                             f"option index 0..{len(options) - 1}, got {choice!r} (the test "
                             f"split hides the answers and cannot be scored)")
        samples.append(Sample(
            id=str(e["id"]),
            video=e["video_path"],
            video_path=str(data_dir / "videos" / e["video_path"]),
            prompt=_options_prompt(f"Question: {e['question']}", options, letters),
            letters=letters,
            gt=letters[choice],
            fields={"duration_group": e["duration_group"],
                    "question_category": e["question_category"]},
        ))
    return samples


def vnbench_category(task_type: str) -> str:
    """ret, ord or cnt from a VNBench type such as ``cnt_edit1``."""
    category = task_type.split("_", 1)[0] if isinstance(task_type, str) else None
    if category not in VNBENCH_CATEGORIES:
        raise ValueError(f"VNBench type {task_type!r} must start with one of "
                         f"{', '.join(c + '_' for c in VNBENCH_CATEGORIES)}")
    return category


def _vnbench(entries: list[dict[str, Any]], data_dir: Path, path: Path) -> list[Sample]:
    samples = []
    for i, e in enumerate(entries):
        _require(e, i, ("video", "question", "options", "gt", "type", "try"), path)
        options = e["options"]
        if not isinstance(options, list):
            raise ValueError(f"{path.name} entry {i}: options must be a list")
        letters = option_letters(len(options))
        vnbench_category(e["type"])
        if e["gt"] not in options:
            raise ValueError(f"{path.name} entry {i}: gt {e['gt']!r} is not among the options")
        gt = letters[options.index(e["gt"])]
        if e.get("gt_option", gt) != gt:
            raise ValueError(f"{path.name} entry {i}: gt_option {e['gt_option']!r} does not "
                             f"name gt {e['gt']!r} (that is option {gt})")
        if e["try"] not in range(VNBENCH_TRIES):
            raise ValueError(f"{path.name} entry {i}: try must be 0..{VNBENCH_TRIES - 1}, "
                             f"got {e['try']!r}")
        sample_id = f"{Path(e['video']).stem}_{e['type']}_{e['try']}"
        samples.append(Sample(
            id=sample_id,
            video=e["video"],
            video_path=os.path.normpath(data_dir / e["video"]),
            prompt=_options_prompt(str(e["question"]), options, letters),
            letters=letters,
            gt=gt,
            fields={"question_id": sample_id, "type": e["type"], "try": e["try"]},
        ))
    return samples


def parse_where(items: list[str]) -> tuple[tuple[str, str], ...]:
    """``["duration_group=600", ...]`` -> ``(("duration_group", "600"), ...)``."""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--where {item!r} must look like FIELD=VALUE")
        pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


def _matches(entry: dict[str, Any], where: tuple[tuple[str, str], ...], path: Path) -> bool:
    for key, value in where:
        if key not in entry:
            raise ValueError(f"--where field {key!r} is not in {path.name}; its fields: "
                             f"{', '.join(sorted(entry))}")
        if str(entry[key]) != value:
            return False
    return True


def load_samples(
    bench: str,
    data_dir: str | os.PathLike[str],
    annotation: str | None = None,
    where: tuple[tuple[str, str], ...] = (),
) -> list[Sample]:
    """The benchmark's samples in annotation order, those whose annotation fields equal every
    ``where`` value (compared as text, e.g. ``("duration_group", "600")``).

    Raises ValueError for a missing or malformed annotation file, duplicate sample ids, a
    LongVideoBench directory without ``videos/``, or a filter that selects nothing. A missing
    video file is not an error here: that sample fails alone when it runs.
    """
    data_dir = Path(data_dir)
    path = annotation_path(bench, data_dir, annotation)
    entries = _read_entries(path)
    kept = [e for e in entries if _matches(e, where, path)]
    if not kept:
        shown = ", ".join(f"{k}={v}" for k, v in where)
        raise ValueError(f"no entry of {path.name} matches {shown}")
    if bench == "longvideobench":
        if not (data_dir / "videos").is_dir():
            raise ValueError(f"{str(data_dir)!r} has no videos/ directory (LongVideoBench "
                             f"keeps its videos in DIR/videos/)")
        samples = _longvideobench(kept, data_dir, path)
    else:
        samples = _vnbench(kept, data_dir, path)
    seen: set[str] = set()
    for s in samples:
        if s.id in seen:
            raise ValueError(f"{path.name} has two entries with the sample id {s.id!r}")
        seen.add(s.id)
    return samples
