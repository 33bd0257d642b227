"""The evaluation loop: the ranks run the samples together, rank 0 writes the results.

Each sample is one engine call on every rank of its group (sequence parallel: the group's ranks
serve the same request), plus one more in exact mode with ``compare="exact"``; one group holds
the whole world unless ``groups`` > 1 (:mod:`apbv.eval.groups`: the samples dealt to the groups,
each round's rows gathered on rank 0). :func:`_call_engine` is the only place that calls the
engine. Rank 0 alone writes, holding an exclusive lock on the output
(:class:`apbv.eval.store.OutputLock`, ``OUT.jsonl.lock``) for the whole run:

    OUT.jsonl           one JSON line per finished sample, appended, flushed and fsynced as it
                        is written (a crash or Ctrl-C loses at most the sample in flight)
    OUT_settings.json   the run's settings (:mod:`apbv.eval.settings`), written when the output
                        is new; a resume under other settings is refused
    OUT_results.json    lmms-eval-style results (:mod:`apbv.eval.score`), rewritten at the end
                        of every run from every line of OUT.jsonl that belongs to the selection

A row (one line) holds, in this order: ``id``, ``task``, ``mode``, ``video``, the benchmark's
own fields (LongVideoBench: ``duration_group``, ``question_category``; VNBench: ``question_id``,
``type``, ``try``), ``gt`` (the right letter), ``pred`` (the decoded answer; "" when the sample
failed), ``parsed_pred`` (its letter or null), ``correct``, ``error`` (null, or why the sample
failed: a missing or corrupt video, too few frames for the ranks), ``token_ids``, ``frames``,
``context_len``, ``query_len``, then ``exact`` (with ``compare="exact"``: exact attention's
``pred``, ``parsed_pred``, ``correct``, ``error``, ``token_ids``, ``same_letter`` (null unless
both answers parsed to a letter) and ``same_tokens``; null when the sample failed) and last
``timing`` (TTFT and per-stage seconds, null when the sample failed). Only ``timing`` differs
between two runs of the same samples. VNBench rows carry ``question_id``, ``pred``, ``gt``,
``type`` and ``try``, so VideoNIAH's own ``evaluation/eval.py`` reads the JSONL as it is.

Resume: rank 0 takes the lock, reads OUT.jsonl, drops a half-written last line (a crash
mid-write; the file is cut back to its last complete line), refuses a file of other settings, of
another benchmark or mode or with a damaged line elsewhere, drops the failed rows of the
selection to run them again (unless ``retry_failed`` is False; the file is rewritten in
annotation order at the end), checks that the video files of the samples to run exist (refusing
to start when some are missing, unless ``skip_missing``), and broadcasts the plan
(:func:`apbv.comm.broadcast_object`, once per run: a few MB for 5400 VNBench samples), so every
rank runs the same remaining samples in the same order. Only rank 0 reads the annotation file
and the JSONL; every rank reads its own frames of each video. A sample that fails with
ValueError (the engine raises it on every rank alike) becomes an error row, scored wrong, and
the run goes on.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from apbv import comm
from apbv.config import AttentionConfig, RuntimeConfig
from apbv.distributed import group_ranks
from apbv.eval.data import (
    BENCHMARKS,
    DEFAULT_MAX_NEW_TOKENS,
    TASK_NAMES,
    Sample,
    annotation_path,
    load_samples,
    missing_videos,
)
from apbv.eval.forecast import predicted_seconds
from apbv.eval.groups import deal, sample_cost
from apbv.eval.parse import parse_choice
from apbv.eval.prompts import family_prompt
from apbv.eval.report import Progress, summary
from apbv.eval.score import Row, letters_agree, results_document
from apbv.eval.settings import check_settings, read_settings, run_settings, write_settings
from apbv.eval.shards import Shard, shard_settings
from apbv.eval.store import OutputLock, ResultLog

__all__ = ["EvalSpec", "OutputLock", "ResultLog", "run_eval", "run_sample", "summary"]

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
    retry_failed: bool = True
    """Run again the samples that failed in an earlier run on this output (their rows are
    replaced); False keeps those rows as they are."""
    skip_missing: bool = False
    """Run even though some video files are missing: their samples are recorded as failed
    without running (and retried by the next run). False: refuse to start."""
    model_type: str | None = None
    """The checkpoint's ``model_type``: its family's lmms-eval system turn
    (:func:`apbv.eval.prompts.family_prompt`); None: the chat template's default turn."""
    groups: int = 1
    """Rank groups: the world runs as ``groups`` sequence-parallel groups of world/groups
    ranks, each answering its share of the samples (:mod:`apbv.eval.groups`)."""
    shard: Shard | None = None
    """Run only this part of the selection (:mod:`apbv.eval.shards`); None: all of it."""

    def __post_init__(self) -> None:
        if self.model_type is not None:
            family_prompt(self.model_type)  # an unknown family fails here, naming the known
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
        if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 1:
            raise ValueError(f"groups must be an integer >= 1, got {self.groups!r}")

    @property
    def task(self) -> str:
        return TASK_NAMES[self.bench]

    @property
    def system(self) -> str | None:
        """The system turn's text of every sample (None: the chat template's default)."""
        return None if self.model_type is None else family_prompt(self.model_type).system

    @property
    def new_tokens(self) -> int:
        if self.max_new_tokens is None:
            return DEFAULT_MAX_NEW_TOKENS[self.bench]
        return self.max_new_tokens

    @property
    def results_path(self) -> Path:
        out = Path(self.out)
        return out.with_name(f"{out.name.removesuffix('.jsonl')}_results.json")


def _call_engine(engine: Any, sample: Sample, mode: str, max_new_tokens: int,
                 system: str | None = None) -> Any:
    """The harness's only call into the engine: answer ``sample`` in ``mode``, greedily, with at
    most ``max_new_tokens`` tokens. The prompt is the sample's plain text (question and options
    as data) with the family's ``system`` text (:attr:`EvalSpec.system`; None: the template's
    default turn); the engine applies the chat template. Returns the engine's result (``answer``,
    ``token_ids``, ``frames``, ``context_len``, ``query_len``, ``ttft_s``, ``seconds``);
    raises ValueError for a bad sample (on every rank alike)."""
    extra = {} if system is None else {"system": system}
    return engine.generate(engine.request(sample.video_path, sample.prompt, mode=mode,
                                          max_new_tokens=max_new_tokens, **extra))


def _failed(error: str) -> Row:
    return {"pred": "", "parsed_pred": None, "correct": False, "error": error,
            "token_ids": [], "frames": None, "context_len": None, "query_len": None}


def _answer(engine: Any, sample: Sample, mode: str, max_new_tokens: int,
            system: str | None = None) -> tuple[Row, dict[str, Any] | None]:
    """One engine call: the answer's row fields, and its timing (None when it failed)."""
    try:
        result = _call_engine(engine, sample, mode, max_new_tokens, system)
    except ValueError as exc:
        return _failed(str(exc)), None
    parsed = parse_choice(result.answer, sample.letters)
    fields = {"pred": result.answer, "parsed_pred": parsed, "correct": parsed == sample.gt,
              "error": None, "token_ids": list(result.token_ids), "frames": result.frames,
              "context_len": result.context_len, "query_len": result.query_len}
    return fields, {"ttft_s": result.ttft_s, "seconds": result.seconds}


def _row_head(sample: Sample, spec: EvalSpec) -> Row:
    return {"id": sample.id, "task": spec.task, "mode": spec.mode, "video": sample.video,
            **sample.fields, "gt": sample.gt}


def failed_row(sample: Sample, spec: EvalSpec, error: str) -> Row:
    """The row of a sample that did not run (its video is missing)."""
    row = {**_row_head(sample, spec), **_failed(error)}
    if spec.compare is not None:
        row["exact"] = None
    row["timing"] = None
    return row


def run_sample(engine: Any, sample: Sample, spec: EvalSpec) -> Row:
    """The row of one sample (every rank computes the same row but its timing)."""
    row = _row_head(sample, spec)
    fields, timing = _answer(engine, sample, spec.mode, spec.new_tokens, spec.system)
    row.update(fields)
    if spec.compare is not None:
        row["exact"] = None
        if timing is not None:
            exact, exact_timing = _answer(engine, sample, spec.compare, spec.new_tokens,
                                          spec.system)
            row["exact"] = {k: exact[k] for k in ("pred", "parsed_pred", "correct", "error",
                                                  "token_ids")}
            row["exact"]["same_letter"] = letters_agree(fields["parsed_pred"],
                                                        exact["parsed_pred"])
            row["exact"]["same_tokens"] = exact["token_ids"] == fields["token_ids"]
            timing["exact"] = exact_timing
    row["timing"] = timing
    return row


@dataclass
class _Plan:
    """What rank 0 decided before any sample runs."""

    samples: list[Sample]
    total: int
    """The selected samples before ``limit``."""
    rows: list[Row]
    """Every row kept in the file (failed rows to retry dropped)."""
    retried: int
    missing: dict[str, str]
    settings: dict[str, Any]
    note: str | None


def _plan(spec: EvalSpec, cfg: RuntimeConfig, log: ResultLog, world: int) -> _Plan:
    """Check everything, then (only when all is well) write the settings and drop the failed
    rows to retry."""
    samples = load_samples(spec.bench, spec.data_dir, spec.annotation, spec.where)
    total = len(samples)
    if spec.limit is not None:
        samples = samples[:spec.limit]
    settings = run_settings(spec, cfg, world_size=world,
                            annotation=annotation_path(spec.bench, spec.data_dir,
                                                       spec.annotation))
    if spec.groups != 1:  # absent for one group, so outputs of earlier runs still resume
        settings["groups"] = spec.groups
    if spec.shard is not None:
        samples = spec.shard.take(samples)
        settings.update(shard_settings(spec.shard, spec.data_dir, spec.where, spec.limit))
    rows, note = log.read(spec.task, spec.mode, spec.compare is not None)
    if rows:
        check_settings(spec.out, read_settings(spec.out), settings, len(rows))
    selected = {s.id for s in samples}
    retry = {r["id"] for r in rows if spec.retry_failed and r["error"] is not None
             and r["id"] in selected}
    kept = [r for r in rows if r["id"] not in retry]
    done = {r["id"] for r in kept}
    missing = missing_videos([s for s in samples if s.id not in done], spec.skip_missing)
    if not rows:
        write_settings(spec.out, settings)
    if retry:
        log.rewrite(kept)
    return _Plan(samples, total, kept, len(retry), missing, settings, note)


def _write_results(spec: EvalSpec, cfg: RuntimeConfig, plan: _Plan, rows: list[Row],
                   world: int) -> dict[str, Any]:
    generation = {"max_new_tokens": spec.new_tokens, "temperature": 0, "do_sample": False}
    config = {
        "model": "apbv",
        "model_args": f"pretrained={cfg.model.path},mode={spec.mode},world_size={world}",
        "batch_size": "1",
        "limit": spec.limit,
        "gen_kwargs": generation,
        "apbv": {"spec": dataclasses.asdict(spec), "settings": plan.settings,
                 "annotation": str(annotation_path(spec.bench, spec.data_dir, spec.annotation)),
                 "world_size": world, "runtime": dataclasses.asdict(cfg)},
    }
    results = results_document(spec.bench, rows, total=plan.total, config=config,
                               generation=generation, compared=spec.compare is not None)
    path = spec.results_path
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return json.loads(text)


def run_eval(
    spec: EvalSpec,
    cfg: RuntimeConfig,
    make_engine: Callable[[], Any],
    *,
    progress: TextIO | None = None,
) -> dict[str, Any] | None:
    """Run the samples of ``spec`` not yet in its JSONL file; call on every rank alike.

    ``make_engine`` is called (on every rank of a group, at its first sample to run on the
    engine; its start-up wait is the group's) only if a sample remains, so a finished run is
    only rescored. ``progress``: where
    rank 0 writes its progress lines (the command line passes stderr; None: nowhere). Returns
    the results document on rank 0 (as written to ``spec.results_path``) and None on the other
    ranks. Raises ValueError on every
    rank for a bad benchmark directory or output file, other settings than the output's, an
    output locked by another run, or missing videos (without ``skip_missing``), before any
    sample runs and before the engine is made.
    """
    rank, world = comm.rank_and_size()
    blocks = group_ranks(world, spec.groups)
    index, group_rank = rank // len(blocks[0]), rank % len(blocks[0])
    log = ResultLog(Path(spec.out))
    lock = OutputLock(spec.out) if rank == 0 else None
    plan: _Plan | None = None
    predicted: dict[str, float] | None = None
    try:
        payload: tuple[str, Any, Any, Any] = ("ok", None, None, None)
        if lock is not None:
            try:
                lock.acquire()
                plan = _plan(spec, cfg, log, world)
                done = {r["id"] for r in plan.rows}
                todo = [s for s in plan.samples if s.id not in done]
                if todo and (progress is not None or spec.groups > 1):  # the cost model's
                    predicted = predicted_seconds([s for s in todo if s.id not in plan.missing],
                                                  cfg, world // spec.groups, 2)  # letter, end
                costs = ([predicted.get(s.id, 0.0) for s in todo] if predicted else
                         [sample_cost(s.video_path) for s in todo])
                dealt = deal(costs, spec.groups)
                payload = ("ok", plan.samples, [[todo[i].id for i in d] for d in dealt],
                           plan.missing)
            except ValueError as exc:
                payload = ("error", str(exc), None, None)
        status, samples, dealt, missing = comm.broadcast_object(payload)
        if status == "error":
            raise ValueError(samples)
        by_id = {s.id: s for s in samples}
        mine = [by_id[i] for i in dealt[index]]
        remaining = sum(len(d) for d in dealt)
        order = {s.id: i for i, s in enumerate(samples)}
        rows = [r for r in plan.rows if r["id"] in order] if plan is not None else []
        tracker = Progress(progress if rank == 0 else None, len(samples), rows,
                           spec.compare is not None, predicted)
        if plan is not None and progress is not None:  # rank 0 (the one that planned)
            if plan.note:
                print(f"[apbv eval] {plan.note}", file=progress, flush=True)
            extra = f", {plan.retried} failed before and run again" if plan.retried else ""
            if missing:
                extra += f", {len(missing)} with missing videos recorded as failed"
            ranks = (f"{world} rank(s)" if spec.groups == 1 else
                     f"{spec.groups} groups of {world // spec.groups} rank(s)")
            shard = "" if spec.shard is None else f" (shard {spec.shard})"
            print(f"[apbv eval] {spec.task}, mode {spec.mode} on {ranks}: "
                  f"{len(samples)} samples{shard}, {len(rows)} already in {spec.out}, "
                  f"{remaining} to run{extra}", file=progress, flush=True)
            if predicted:
                print(f"[apbv eval] the cost model's ETA weights for {len(predicted)} "
                      f"sample(s) (scaled by the measured time as samples finish)",
                      file=progress, flush=True)
        engine = None
        for turn in range(max(len(d) for d in dealt)):
            row = None
            if turn < len(mine):
                sample = mine[turn]
                if sample.id in missing:
                    row = failed_row(sample, spec, missing[sample.id])
                else:
                    engine = make_engine() if engine is None else engine
                    row = run_sample(engine, sample, spec)
            # one round: every group's row (from its query rank) meets on rank 0
            finished = [row] if spec.groups == 1 else comm.all_gather_object(
                row if group_rank == 0 else None)
            for done_row in (r for r in finished if r is not None):
                if plan is not None:  # rank 0
                    log.append(done_row)
                    rows.append(done_row)
                    plan.rows.append(done_row)
                tracker.update(done_row)
        tracker.close()
        if plan is None:  # not rank 0
            return None
        if plan.retried or spec.groups > 1:  # rows written out of order: put them in order
            log.rewrite(sorted(plan.rows, key=lambda r: order.get(r["id"], len(order))))
        rows.sort(key=lambda r: order[r["id"]])
        results = _write_results(spec, cfg, plan, rows, world)
        if progress is not None:
            print(f"[apbv eval] results: {spec.results_path}", file=progress, flush=True)
        return results
    finally:
        log.close()
        if lock is not None:
            lock.release()
