"""The evaluation loop: every rank runs every sample together, rank 0 writes the results.

Each sample is one :meth:`apbv.engine.Engine.generate` call on every rank (sequence parallel:
all ranks serve the same request), plus one more in exact mode with ``compare="exact"``. Rank 0
alone writes two files:

    OUT.jsonl          one JSON line per finished sample, appended, flushed and fsynced as it
                       is written (a crash or Ctrl-C loses at most the sample in flight)
    OUT_results.json   lmms-eval-style results (:mod:`apbv.eval.score`), rewritten at the end
                       of every run from every line of OUT.jsonl that belongs to the selection

A row (one line) holds, in this order: ``id``, ``task``, ``mode``, ``video``, the benchmark's
own fields (LongVideoBench: ``duration_group``, ``question_category``; VNBench: ``question_id``,
``type``, ``try``), ``gt`` (the right letter), ``pred`` (the decoded answer; "" when the sample
failed), ``parsed_pred`` (its letter or null), ``correct``, ``error`` (null, or why the sample
failed: a missing or corrupt video, too few frames for the ranks), ``token_ids``, ``frames``,
``context_len``, ``query_len``, then ``exact`` (with ``compare="exact"``: exact attention's
``pred``, ``parsed_pred``, ``correct``, ``error``, ``token_ids``, and ``same_letter`` /
``same_tokens`` against the mode; null when the sample failed) and last ``timing`` (TTFT and
per-stage seconds, null when the sample failed). Only ``timing`` differs between two runs of
the same samples. VNBench rows carry ``question_id``, ``pred``, ``gt``, ``type`` and ``try``, so
VideoNIAH's own ``evaluation/eval.py`` reads the JSONL as it is.

Resume: rank 0 reads OUT.jsonl, drops a half-written last line (a crash mid-write; the file is
cut back to its last complete line), refuses a file of another benchmark or mode or with a
damaged line elsewhere, and broadcasts the selected samples and the ids already done
(:func:`apbv.comm.broadcast_object`, once per run: a few MB for 5400 VNBench samples), so every
rank runs the same remaining samples in the same order. Only rank 0 reads the annotation file
and the JSONL; every rank reads its own frames of each video. A sample that fails with ValueError (the engine raises it on every rank alike) becomes an
error row, scored wrong, and the run goes on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from apbv import comm
from apbv.config import AttentionConfig, RuntimeConfig, to_dict
from apbv.eval.data import (
    BENCHMARKS,
    DEFAULT_MAX_NEW_TOKENS,
    TASK_NAMES,
    Sample,
    annotation_path,
    load_samples,
)
from apbv.eval.parse import parse_choice
from apbv.eval.score import Row, results_document

COMPARE = ("exact",)
"""What ``compare`` accepts: the mode whose answers each sample is also checked against."""


@dataclass(frozen=True)
class EvalSpec:
    """One evaluation run; the same on every rank."""

    bench: str
    """longvideobench or vnbench."""
    data_dir: str
    """The benchmark's local directory (annotation file and videos)."""
    out: str
    """The JSONL file; the results file is written next to it (OUT_results.json)."""
    mode: str = "spava"
    annotation: str | None = None
    """Annotation file name in data_dir, or a path; None: the benchmark's default name."""
    limit: int | None = None
    """Run only the first ``limit`` samples (after ``where``), in annotation order."""
    where: tuple[tuple[str, str], ...] = ()
    """Keep the samples whose annotation fields equal these values, e.g. duration_group=600."""
    compare: str | None = None
    """"exact": also answer each sample with exact attention and report the agreement."""
    max_new_tokens: int | None = None
    """None: the benchmark's default (LongVideoBench 32, as lmms-eval; VNBench 5)."""

    def __post_init__(self) -> None:
        if self.bench not in BENCHMARKS:
            raise ValueError(f"unknown benchmark {self.bench!r}; allowed: "
                             f"{', '.join(BENCHMARKS)}")
        AttentionConfig(mode=self.mode)  # an unknown mode fails here, naming the allowed ones
        if self.compare is not None and self.compare not in COMPARE:
            raise ValueError(f"compare must be one of {', '.join(COMPARE)}; got "
                             f"{self.compare!r}")
        if self.compare == self.mode:
            raise ValueError(f"compare={self.compare} with mode {self.mode} compares a mode "
                             f"with itself; pick another mode")
        for name in ("limit", "max_new_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.out:
            raise ValueError("out must name the JSONL file to write")

    @property
    def task(self) -> str:
        return TASK_NAMES[self.bench]

    @property
    def new_tokens(self) -> int:
        if self.max_new_tokens is None:
            return DEFAULT_MAX_NEW_TOKENS[self.bench]
        return self.max_new_tokens

    @property
    def results_path(self) -> Path:
        out = Path(self.out)
        return out.with_name(f"{out.name.removesuffix('.jsonl')}_results.json")


class ResultLog:
    """The JSONL file of finished samples: read (and repaired) on resume, then appended to."""

    def __init__(self, path: Path):
        self.path = path
        self._file: Any = None

    def read(self, task: str, mode: str, compare: bool) -> tuple[list[Row], str | None]:
        """The rows already written, and a note when a half-written last line was cut off.

        Raises ValueError for a damaged line before the last, a line that is not a row, a
        sample id twice, or rows of another task or mode, or with(out) the comparison against
        exact attention when this run is not (resuming into them would mix runs).
        """
        if not self.path.exists():
            return [], None
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        tail = lines.pop()  # the bytes after the last newline: b"" unless cut mid-write
        rows: list[Row] = []
        kept = 0
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not isinstance(row, dict) or "id" not in row:
                if number == len(lines) and not tail:
                    tail = line
                    break
                raise ValueError(f"{self.path} line {number} is not a result row; the file is "
                                 f"damaged (move it away to start over)")
            if row.get("task") != task or row.get("mode") != mode:
                raise ValueError(f"{self.path} holds results of task {row.get('task')} in mode "
                                 f"{row.get('mode')}, not {task} in mode {mode}; pass another "
                                 f"output file")
            if ("exact" in row) != compare:
                raise ValueError(f"{self.path} holds results {'without' if compare else 'with'} "
                                 f"the comparison against exact attention, unlike this run; "
                                 f"pass another output file")
            rows.append(row)
            kept += len(line) + 1
        ids = [r["id"] for r in rows]
        if len(set(ids)) != len(ids):
            twice = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"{self.path} has sample ids more than once: {', '.join(twice)}")
        if not tail:
            return rows, None
        os.truncate(self.path, kept)
        return rows, (f"dropped a half-written last line of {self.path} "
                      f"({len(data) - kept} bytes)")

    def append(self, row: Row) -> None:
        """Write one row as one line; it is on disk when this returns."""
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _answer(engine: Any, sample: Sample, mode: str,
            max_new_tokens: int) -> tuple[Row, dict[str, Any] | None]:
    """One generate call: the answer's row fields, and its timing (None when it failed)."""
    try:
        result = engine.generate(engine.request(sample.video_path, sample.prompt, mode=mode,
                                                max_new_tokens=max_new_tokens))
    except ValueError as exc:
        return {"pred": "", "parsed_pred": None, "correct": False, "error": str(exc),
                "token_ids": [], "frames": None, "context_len": None, "query_len": None}, None
    parsed = parse_choice(result.answer, sample.letters)
    fields = {"pred": result.answer, "parsed_pred": parsed, "correct": parsed == sample.gt,
              "error": None, "token_ids": list(result.token_ids), "frames": result.frames,
              "context_len": result.context_len, "query_len": result.query_len}
    return fields, {"ttft_s": result.ttft_s, "seconds": result.seconds}


def run_sample(engine: Any, sample: Sample, spec: EvalSpec) -> Row:
    """The row of one sample (every rank computes the same row but its timing)."""
    row: Row = {"id": sample.id, "task": spec.task, "mode": spec.mode, "video": sample.video,
                **sample.fields, "gt": sample.gt}
    fields, timing = _answer(engine, sample, spec.mode, spec.new_tokens)
    row.update(fields)
    if spec.compare is not None:
        row["exact"] = None
        if timing is not None:
            exact, exact_timing = _answer(engine, sample, spec.compare, spec.new_tokens)
            row["exact"] = {k: exact[k] for k in ("pred", "parsed_pred", "correct", "error",
                                                  "token_ids")}
            row["exact"]["same_letter"] = exact["parsed_pred"] == fields["parsed_pred"]
            row["exact"]["same_tokens"] = exact["token_ids"] == fields["token_ids"]
            timing["exact"] = exact_timing
    row["timing"] = timing
    return row


class Progress:
    """One stderr line per finished sample on rank 0: done/total, ETA, running accuracy."""

    def __init__(self, stream: TextIO | None, total: int, rows: list[Row], compare: bool):
        self.stream = stream
        self.total = total
        self.done = len(rows)
        self.correct = sum(bool(r["correct"]) for r in rows)
        self.errors = sum(r["error"] is not None for r in rows)
        self.compare = compare
        self.compared = [r["exact"]["same_letter"] for r in rows
                         if compare and r["exact"] is not None and r["exact"]["error"] is None]
        self.new = 0
        self.start = time.monotonic()

    def update(self, row: Row) -> None:
        self.done += 1
        self.new += 1
        self.correct += bool(row["correct"])
        self.errors += row["error"] is not None
        if self.compare and row["exact"] is not None and row["exact"]["error"] is None:
            self.compared.append(row["exact"]["same_letter"])
        if self.stream is None:
            return
        elapsed = time.monotonic() - self.start
        eta = timedelta(seconds=round(elapsed / self.new * (self.total - self.done)))
        line = (f"[{self.done}/{self.total}] {100 * self.done / self.total:.1f}%  eta {eta}  "
                f"acc {self.correct / self.done:.3f}")
        if self.errors:
            line += f"  errors {self.errors}"
        if self.compared:
            line += f"  agree {sum(self.compared) / len(self.compared):.3f}"
        print(line, file=self.stream, flush=True)


def _plan(spec: EvalSpec, log: ResultLog) -> tuple[list[Sample], int, list[Row], str | None]:
    """The selected samples, how many there are without --limit, the rows already done and
    the note of a repaired file."""
    samples = load_samples(spec.bench, spec.data_dir, spec.annotation, spec.where)
    total = len(samples)
    if spec.limit is not None:
        samples = samples[:spec.limit]
    rows, note = log.read(spec.task, spec.mode, spec.compare is not None)
    return samples, total, rows, note


def run_eval(
    spec: EvalSpec,
    cfg: RuntimeConfig,
    make_engine: Callable[[], Any],
    *,
    progress: TextIO | None = None,
) -> dict[str, Any] | None:
    """Run the samples of ``spec`` not yet in its JSONL file; call on every rank alike.

    ``make_engine`` is called (on every rank) only if a sample remains, so a finished run is
    only rescored. ``progress``: where rank 0 writes its progress lines (the command line
    passes stderr; None: nowhere). Returns the results document on rank 0 (as written to
    ``spec.results_path``) and None on the other ranks. Raises ValueError on every rank for a
    bad benchmark directory or output file, before any sample runs.
    """
    rank, world = comm.rank_and_size()
    log = ResultLog(Path(spec.out))
    payload: tuple[str, Any, Any] | None = None
    rows: list[Row] = []
    total = 0
    if rank == 0:
        try:
            samples, total, rows, note = _plan(spec, log)
            payload = ("ok", samples, {r["id"] for r in rows})
            if note and progress is not None:
                print(f"[apbv eval] {note}", file=progress, flush=True)
        except ValueError as exc:
            payload = ("error", str(exc), None)
    status, samples, done = comm.broadcast_object(payload)
    if status == "error":
        raise ValueError(samples)
    remaining = [s for s in samples if s.id not in done]
    selected = {s.id for s in samples}
    rows = [r for r in rows if r["id"] in selected]
    tracker = Progress(progress if rank == 0 else None, len(samples), rows,
                       spec.compare is not None)
    if rank == 0 and progress is not None:
        print(f"[apbv eval] {spec.task}, mode {spec.mode} on {world} rank(s): "
              f"{len(samples)} samples, {len(rows)} already in {spec.out}, "
              f"{len(remaining)} to run", file=progress, flush=True)
    if remaining:
        engine = make_engine()
        try:
            for sample in remaining:
                row = run_sample(engine, sample, spec)
                if rank == 0:
                    log.append(row)
                    rows.append(row)
                tracker.update(row)
        finally:
            log.close()
    if rank != 0:
        return None
    order = {s.id: i for i, s in enumerate(samples)}
    rows.sort(key=lambda r: order[r["id"]])
    generation = {"max_new_tokens": spec.new_tokens, "temperature": 0, "do_sample": False}
    config = {
        "model": "apbv",
        "model_args": f"pretrained={cfg.model.path},mode={spec.mode},world_size={world}",
        "batch_size": "1",
        "limit": spec.limit,
        "gen_kwargs": generation,
        "apbv": {"spec": dataclasses.asdict(spec),
                 "annotation": str(annotation_path(spec.bench, spec.data_dir, spec.annotation)),
                 "world_size": world, "runtime": to_dict(cfg)},
    }
    results = results_document(spec.bench, rows, total=total, config=config,
                               generation=generation, compared=spec.compare is not None)
    path = spec.results_path
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)
    if progress is not None:
        print(f"[apbv eval] results: {path}", file=progress, flush=True)
    return json.loads(text)


def _fraction(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def summary(results: dict[str, Any]) -> str:
    """A few lines for the terminal: the headline metrics, the breakdown, the agreement."""
    details = results["apbv"]
    bench, scores = details["benchmark"], details["scores"]
    (task, table), = results["results"].items()
    metrics = "  ".join(f"{k.split(',')[0]} {_fraction(v)}" for k, v in table.items()
                        if k.endswith(",none") and "_stderr" not in k)
    lines = [(f"{task}: {metrics}  ({scores['num']} samples, {scores['errors']} failed, "
              f"{scores['unparsed']} unparsed)")]
    if bench == "longvideobench":
        for key in ("duration_group", "question_category"):
            parts = [f"{name} {_fraction(s['acc'])} ({s['num']})"
                     for name, s in scores[key].items()]
            lines.append(f"  {key}: " + ", ".join(parts))
    else:
        parts = [f"{name} {_fraction(s['acc'])} ({s['questions']})"
                 for name, s in scores["types"].items()]
        lines.append("  per type (questions with all 4 tries right): " + ", ".join(parts))
        if scores["incomplete_questions"]:
            lines.append(f"  {scores['incomplete_questions']} question(s) without all 4 tries "
                         f"run are not scored")
    if "compare_exact" in details:
        c = details["compare_exact"]
        lines.append(f"  agreement with exact attention over {c['compared']} samples: letters "
                     f"{_fraction(c['letter_agreement'])}, tokens "
                     f"{_fraction(c['token_agreement'])}")
    return "\n".join(lines)
