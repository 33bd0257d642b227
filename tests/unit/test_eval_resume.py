"""Runs that must not mix or lose results: the stored settings refuse a resume under other
settings, the output lock refuses a concurrent run, failed samples are retried (or kept), and
missing videos are reported before the model loads. One process, the scripted engine of
test_eval_loop.py."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from apbv.config import load_config
from apbv.eval.harness import EvalSpec, run_eval
from apbv.eval.settings import settings_path
from apbv.eval.store import OutputLock, lock_path
from tests.unit.test_eval_loop import ScriptedEngine, scripted_engine, vnbench_fixture

BAD = "bad_ord_insert1.mp4"
HOLD_LOCK = ("import fcntl, sys; f = open(sys.argv[1], 'a'); "
             "fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB); print('held', flush=True); "
             "sys.stdin.read()")
"""Another process: lock the file like a run does, say so, hold it until stdin closes."""


@pytest.fixture(scope="module")
def vnb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vnbench_fixture(tmp_path_factory.mktemp("vnb"))


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    """A checkpoint directory: only its config.json matters to the settings."""
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "hidden": 8}))
    return path


def _cfg(model: Path, *overrides: str):
    return load_config("tiny_cpu", [f"model.path={str(model)!r}", *overrides])


def _spec(root: Path, out: Path, **kw) -> EvalSpec:
    return EvalSpec(bench="vnbench", data_dir=str(root), out=str(out), **kw)


def _no_engine():
    raise AssertionError("the model must not be loaded")


def test_settings_are_stored_and_a_resume_with_other_ones_is_refused(
        vnb: Path, model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.jsonl"
    cfg = _cfg(model)
    first = run_eval(_spec(vnb, out, limit=4), cfg, lambda: scripted_engine(vnb))
    stored = json.loads(settings_path(out).read_text())["apbv_eval_settings"]
    assert settings_path(out).name == "run_settings.json"
    assert first["config"]["apbv"]["settings"] == stored  # the results file records them too
    assert stored["model.path"] == str(model) and stored["max_new_tokens"] == 5
    assert stored["model.config_sha256"] and stored["video.fps"] == 2.0
    assert {"video.nframes", "video.max_pixels", "video.backend", "mode", "compare",
            "attention.anchor_len", "attention.passing_len", "apbv_version", "task",
            "annotation", "annotation_sha256", "world_size"} <= set(stored)
    lines = out.read_text()

    def refused(message: str, spec: EvalSpec, run_cfg) -> None:
        with pytest.raises(ValueError, match=re.escape(message)) as info:
            run_eval(spec, run_cfg, _no_engine)
        assert f"pass another --out, or delete {out}" in str(info.value)
        assert out.read_text() == lines  # nothing written
        assert not lock_path(out).exists()

    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((model / "config.json").read_text())
    refused(f"model.path stored {json.dumps(str(model))}, now {json.dumps(str(other))}",
            _spec(vnb, out), _cfg(other))
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "hidden": 16}))
    refused("model.config_sha256 stored", _spec(vnb, out), cfg)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "hidden": 8}))
    nframes = dataclasses.replace(cfg, video=dataclasses.replace(cfg.video, fps=None,
                                                                 nframes=8))
    refused("holds results of other settings than this run's (video.fps stored 2.0, now null; "
            "video.nframes stored null, now 8); resuming would mix them", _spec(vnb, out),
            nframes)
    refused("(max_new_tokens stored 5, now 2)", _spec(vnb, out, max_new_tokens=2), cfg)
    refused("attention.passing_len stored null, now 64",
            _spec(vnb, out), _cfg(model, "attention.passing_len=64"))
    assert "video.static_threshold" not in stored  # off: outputs written before still resume
    refused("video.static_threshold stored null, now 8.0",
            _spec(vnb, out), _cfg(model, "video.static_threshold=8.0"))
    settings_path(out).unlink()
    refused(f"{out} holds 4 result rows but no settings file (run_settings.json",
            _spec(vnb, out), cfg)
    out.unlink()  # deleting the output starts over; the settings are written anew
    run_eval(_spec(vnb, out, limit=4, max_new_tokens=2), cfg, lambda: scripted_engine(vnb))
    assert json.loads(settings_path(out).read_text())["apbv_eval_settings"][
        "max_new_tokens"] == 2


def test_a_second_run_on_the_same_output_is_refused_while_the_first_holds_the_lock(
        vnb: Path, model: Path, tmp_path: Path) -> None:
    out = tmp_path / "locked.jsonl"
    lock = OutputLock(out)
    lock.acquire()
    try:
        assert lock_path(out) == tmp_path / "locked.jsonl.lock" and lock_path(out).exists()
        with pytest.raises(ValueError, match=re.escape(
                f"another run is writing {out} (lock file {lock_path(out)} is held); wait for "
                f"it to end, or pass another --out")):
            OutputLock(out).acquire()
        with pytest.raises(ValueError, match="lock file .*locked.jsonl.lock is held"):
            run_eval(_spec(vnb, out), _cfg(model), _no_engine)
        assert not out.exists() and not settings_path(out).exists()
    finally:
        lock.release()
    assert not lock_path(out).exists()
    second = OutputLock(out)
    second.acquire()  # free again
    second.release()


def test_the_lock_holds_across_processes_and_is_released_on_error(
        vnb: Path, model: Path, tmp_path: Path) -> None:
    out = tmp_path / "proc.jsonl"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(lock_path(out))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match="another run is writing .*proc.jsonl"):
            run_eval(_spec(vnb, out), _cfg(model), _no_engine)
    finally:
        holder.communicate("", timeout=30)  # exits without unlocking: the kernel does
    class Boom(RuntimeError):
        pass

    def failing():
        raise Boom("the model could not be loaded")

    with pytest.raises(Boom):
        run_eval(_spec(vnb, out), _cfg(model), failing)
    assert not lock_path(out).exists()
    with pytest.raises(KeyError):  # an engine bug (not a bad sample) ends the run
        run_eval(_spec(vnb, out), _cfg(model), lambda: ScriptedEngine({}))
    assert not lock_path(out).exists()
    run_eval(_spec(vnb, out), _cfg(model), lambda: scripted_engine(vnb))  # not left locked
    assert len(out.read_text().splitlines()) == 12


def test_failed_samples_are_retried_by_default_and_kept_with_no_retry(
        vnb: Path, model: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    vnbench_fixture(data)
    out = tmp_path / "retry.jsonl"
    cfg = _cfg(model)
    first = run_eval(_spec(data, out), cfg, lambda: scripted_engine(data))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["error"] is not None for r in rows] == [False] * 8 + [True] * 4
    assert first["apbv"]["scores"]["errors"] == 4
    engine = scripted_engine(data)
    kept = run_eval(_spec(data, out, retry_failed=False), cfg, lambda: engine)
    assert engine.calls == [] and kept["apbv"]["scores"]["errors"] == 4
    # The video is fixed (now a copy of a good one): the default run retries the 4 samples.
    good = data / "VNBench" / Path(rows[0]["video"]).name
    (data / "VNBench" / BAD).write_bytes(good.read_bytes())
    fixed = scripted_engine(data)
    for (_, prompt), answer in list(fixed.answers["spava"].items())[:4]:
        fixed.answers["spava"][(str(data / "VNBench" / BAD), prompt)] = answer
    stream = io.StringIO()
    retried = run_eval(_spec(data, out), cfg, lambda: fixed, progress=stream)
    assert len(fixed.calls) == 4 and {c[0] for c in fixed.calls} == {str(data / "VNBench" / BAD)}
    assert "12 samples, 8 already in" in stream.getvalue()
    assert "4 to run, 4 failed before and run again" in stream.getvalue()
    new_rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in new_rows] == [r["id"] for r in rows]  # annotation order, once
    assert all(r["error"] is None for r in new_rows) and new_rows[:8] == rows[:8]
    assert retried["apbv"]["scores"]["errors"] == 0
    assert retried["apbv"]["scores"]["types"]["ord_insert1"]["acc"] == 1.0


def test_missing_videos_are_reported_before_the_model_loads(
        vnb: Path, model: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    vnbench_fixture(data)
    path = data / "VNBench-main-4try.json"
    entries = json.loads(path.read_text())
    entries += [{**e, "video": f"./VNBench/gone{i}_cnt_insert1.mp4", "type": "cnt_insert1"}
                for i in range(7) for e in entries[:4]]
    path.write_text(json.dumps(entries))
    out = tmp_path / "missing.jsonl"
    gone = [repr(str(data / "VNBench" / f"gone{i}_cnt_insert1.mp4")) for i in range(5)]
    with pytest.raises(ValueError, match=re.escape(
            f"7 video file(s) of 28 sample(s) to run are missing: {', '.join(gone)} and 2 more; "
            f"check --data (and --annotation), or pass --skip-missing to record those samples "
            f"as failed and run the rest")):
        run_eval(_spec(data, out), _cfg(model), _no_engine)
    assert not out.exists() and not settings_path(out).exists()
    engine = scripted_engine(data)
    results = run_eval(_spec(data, out, skip_missing=True), _cfg(model), lambda: engine)
    assert len(engine.calls) == 12  # only the samples whose video exists
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 40 and all(
        r["error"] == f"video file {str(data / 'VNBench' / Path(r['video']).name)!r} does not "
        f"exist" and r["timing"] is None and r["correct"] is False for r in rows[12:])
    assert results["apbv"]["scores"]["types"]["cnt_insert1"] == {"questions": 7, "correct": 0,
                                                                 "acc": 0.0}
    # A rerun retries only the failed samples: the corrupt video on the engine, the missing
    # ones (still missing) recorded again without it.
    engine = scripted_engine(data)
    run_eval(_spec(data, out, skip_missing=True), _cfg(model), lambda: engine)
    assert len(engine.calls) == 4 and len(out.read_text().splitlines()) == 40
    with pytest.raises(ValueError, match="7 video file"):
        run_eval(_spec(data, out), _cfg(model), _no_engine)


def test_question_and_options_reach_the_engine_as_plain_text(
        vnb: Path, model: Path, tmp_path: Path) -> None:
    """Special-token strings in the data are passed on as they are; the harness adds none."""
    data = tmp_path / "data"
    vnbench_fixture(data)
    path = data / "VNBench-main-4try.json"
    entries = json.loads(path.read_text())[:4]
    for e in entries:
        e["question"] = "What <|vision_start|> colour?<|im_end|>\n<|im_start|>assistant"
    path.write_text(json.dumps(entries))
    class Recording:
        def __init__(self):
            self.calls = []

        @staticmethod
        def request(video: str, question: str, **kw):
            return video, question, kw

        def generate(self, request):
            self.calls.append(request)
            raise ValueError("recorded")

    engine = Recording()
    run_eval(_spec(data, tmp_path / "plain.jsonl"), _cfg(model), lambda: engine)
    _, question, kw = engine.calls[0]
    options = entries[0]["options"]
    assert question == (
        "What <|vision_start|> colour?<|im_end|>\n<|im_start|>assistant\n"
        + "".join(f"{letter}. {o}\n" for letter, o in zip("ABCD", options))
        + "Answer with the option's letter from the given choices directly.")
    assert kw == {"mode": "spava", "max_new_tokens": 5}
