"""The two benchmarks' own annotation files, read from a local directory, and their prompts.

LongVideoBench (validation split, as released on the HF hub ``longvideobench/LongVideoBench``)::

    DIR/lvb_val.json      [{"id", "video_path", "question", "candidates": [...],
                            "correct_choice": int, "duration_group", "question_category",
                            "duration", "subtitle_path", ...}, ...]
    DIR/videos/<video_path>

  ``candidates`` may instead be lmms-eval's ``option0``..``option4`` ("N/A" when unused). The
  test split hides ``correct_choice`` and cannot be scored here. Prompt (one text block after the
  video), byte for byte lmms-eval's ``longvideobench_val_v`` (``pre_prompt`` "", the question,
  the options one per line, ``post_prompt`` with its trailing newline; no subtitles)::

    {question}
    A. {candidate 0}
    B. {candidate 1}
    ...
    Answer with the option's letter from the given choices directly.
    <- the prompt ends with this newline

  LongVideoBench's own dataset code differs: it prefixes "Question: " and has no trailing
  newline; the APB reference concatenates the items with no separator. The results are named
  after lmms-eval's task, so its text is the one used.

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

Question and option text are data: they go into the prompt as they are (``str()`` of a number),
and the harness adds no special token of its own; the chat template and the tokenizer decide
how the text is tokenized. A malformed entry is a ValueError naming the file, the entry's index
and id, and the field.

Every sample gets the same frame sampling, from the engine's video config, whatever the mode.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apbv.eval.parse import OPTION_LETTERS, option_letters

BENCHMARKS = ("longvideobench", "vnbench")
DEFAULT_ANNOTATION = {"longvideobench": "lvb_val.json", "vnbench": "VNBench-main-4try.json"}
TASK_NAMES = {"longvideobench": "longvideobench_val_v", "vnbench": "vnbench"}
"""Result names: lmms-eval's task name for LongVideoBench; VNBench is no lmms-eval task."""
DEFAULT_MAX_NEW_TOKENS = {"longvideobench": 32, "vnbench": 5}
"""lmms-eval's generation_kwargs for longvideobench_val_v; the VNBench runners' value."""
INSTRUCTION = "Answer with the option's letter from the given choices directly."
LVB_POST_PROMPT = INSTRUCTION + "\n"
"""lmms-eval's ``post_prompt`` of ``longvideobench_val_v``, trailing newline included."""
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


def _entry(path: Path, index: int, entry_id: Any) -> str:
    """How an error names an entry: file, index and id."""
    shown = "unknown" if entry_id is None else repr(entry_id)
    return f"{path.name} entry {index} (id {shown})"


def _require(entry: dict[str, Any], where: str, keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in entry]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}")


def _text(entry: dict[str, Any], key: str, where: str, *, numbers: bool = False) -> str:
    """A text field (a file name, a question, an option): a non-empty string, or with
    ``numbers`` also an integer or float (VNBench's counting options), returned as text."""
    value = entry[key]
    if isinstance(value, str) and value.strip():
        return value
    if numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    kind = "a non-empty string or a number" if numbers else "a non-empty string"
    raise ValueError(f"{where}: field {key!r} must be {kind}, got {value!r}")


def _options(entry: dict[str, Any], key: str, where: str, *, numbers: bool) -> list[str]:
    options = entry[key]
    if not isinstance(options, list):
        raise ValueError(f"{where}: field {key!r} must be a list, got {options!r}")
    if not 2 <= len(options) <= len(OPTION_LETTERS):
        raise ValueError(f"{where}: field {key!r} must hold 2..{len(OPTION_LETTERS)} options, "
                         f"got {len(options)}")
    return [_text({key: o}, key, where, numbers=numbers) for o in options]


def _options_prompt(lead: str, options: list[str], letters: str, end: str) -> str:
    lines = [lead] + [f"{letter}. {option}" for letter, option in zip(letters, options)]
    return "\n".join(lines + [end])


def choice_prompt(bench: str, question: str, options: list[str]) -> str:
    """The user text after the video that the harness builds for a ``bench`` question with
    these options (LongVideoBench: lmms-eval's, trailing newline included; VNBench:
    VideoNIAH's); the same function the annotation readers use."""
    _check_bench(bench)
    end = LVB_POST_PROMPT if bench == "longvideobench" else INSTRUCTION
    return _options_prompt(question, options, option_letters(len(options)), end)


def _longvideobench(entries: list[dict[str, Any]], data_dir: Path, path: Path) -> list[Sample]:
    samples = []
    for i, e in enumerate(entries):
        where = _entry(path, i, e.get("id"))
        _require(e, where, ("id", "video_path", "question", "duration_group",
                            "question_category"))
        if isinstance(e["id"], bool) or not isinstance(e["id"], (str, int)):
            raise ValueError(f"{where}: field 'id' must be a string, got {e['id']!r}")
        video = _text(e, "video_path", where)
        question = _text(e, "question", where)
        if "candidates" in e:
            options = _options(e, "candidates", where, numbers=False)
        else:
            columns = {f"option{j}": e[f"option{j}"] for j in range(5)
                       if e.get(f"option{j}", "N/A") != "N/A"}
            options = _options({"option0..option4": [*columns.values()]}, "option0..option4",
                               where, numbers=False)
        letters = option_letters(len(options))
        choice = e.get("correct_choice")
        if isinstance(choice, bool) or not isinstance(choice, int) or \
                not 0 <= choice < len(options):
            raise ValueError(f"{where}: field 'correct_choice' must be an option index "
                             f"0..{len(options) - 1}, got {choice!r} (the test split hides the "
                             f"answers and cannot be scored)")
        samples.append(Sample(
            id=str(e["id"]),
            video=video,
            video_path=str(data_dir / "videos" / video),
            prompt=_options_prompt(question, options, letters, LVB_POST_PROMPT),
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


def _vnbench_id(entry: dict[str, Any]) -> str | None:
    """``{video file stem}_{type}_{try}`` when those fields allow it, else None."""
    video, task_type, attempt = entry.get("video"), entry.get("type"), entry.get("try")
    if not isinstance(video, str) or not video.strip() or not isinstance(task_type, str) or \
            isinstance(attempt, bool) or not isinstance(attempt, int):
        return None
    return f"{Path(video).stem}_{task_type}_{attempt}"


def _vnbench(entries: list[dict[str, Any]], data_dir: Path, path: Path) -> list[Sample]:
    samples = []
    for i, e in enumerate(entries):
        sample_id = _vnbench_id(e)
        where = _entry(path, i, sample_id)
        _require(e, where, ("video", "question", "options", "gt", "type", "try"))
        video = _text(e, "video", where)
        question = _text(e, "question", where)
        options = _options(e, "options", where, numbers=True)
        letters = option_letters(len(options))
        try:
            vnbench_category(e["type"])
        except ValueError as exc:
            raise ValueError(f"{where}: field 'type': {exc}") from None
        if e["gt"] not in e["options"]:
            raise ValueError(f"{where}: field 'gt' {e['gt']!r} is not among the options")
        gt = letters[e["options"].index(e["gt"])]
        if e.get("gt_option", gt) != gt:
            raise ValueError(f"{where}: field 'gt_option' {e['gt_option']!r} does not name gt "
                             f"{e['gt']!r} (that is option {gt})")
        if isinstance(e["try"], bool) or e["try"] not in range(VNBENCH_TRIES):
            raise ValueError(f"{where}: field 'try' must be 0..{VNBENCH_TRIES - 1}, "
                             f"got {e['try']!r}")
        assert sample_id is not None  # video, type and try are checked above
        samples.append(Sample(
            id=sample_id,
            video=video,
            video_path=os.path.normpath(data_dir / video),
            prompt=_options_prompt(question, options, letters, INSTRUCTION),
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


SHOWN_MISSING = 5
"""How many missing video files the preflight names."""


def missing_videos(samples: list[Sample], skip: bool) -> dict[str, str]:
    """{sample id: error} of the samples whose video file is missing. Raises ValueError
    counting them all and naming the first few files unless ``skip``."""
    files = {s.video_path for s in samples if not os.path.isfile(s.video_path)}
    if not files:
        return {}
    missing = {s.id: f"video file {s.video_path!r} does not exist"
               for s in samples if s.video_path in files}
    if not skip:
        ordered = sorted(files)
        shown = ", ".join(repr(f) for f in ordered[:SHOWN_MISSING])
        more = f" and {len(files) - SHOWN_MISSING} more" if len(files) > SHOWN_MISSING else ""
        raise ValueError(f"{len(files)} video file(s) of {len(missing)} sample(s) to run are "
                         f"missing: {shown}{more}; check --data (and --annotation), or pass "
                         f"--skip-missing to record those samples as failed and run the rest")
    return missing
