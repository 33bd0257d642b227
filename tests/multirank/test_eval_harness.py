"""The evaluation harness end to end with the tiny model: both fixture formats on 2 gloo ranks,
a killed-then-resumed run equal to an uninterrupted one, error rows for broken videos, the
comparison against exact attention, and the command line (one process and under torchrun).

The tiny model's answers are random tokens, so these tests check the mechanics, not accuracy.
Runs are compared on their JSONL lines with the ``timing`` field removed (the only field that
differs between two runs of the same samples), and on their results files without ``date``
and ``config`` (which names the output file).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from apbv import comm
from apbv.__main__ import main
from apbv.config import RuntimeConfig
from apbv.distributed import DistInfo, spawn_local
from apbv.engine.engine import Engine
from apbv.eval.harness import EvalSpec, run_eval
from apbv.synthetic.eval_fixtures import make_eval_fixtures
from tests.unit.test_eval_loop import add_vnbench_tries

ROOT = Path(__file__).resolve().parents[2]
PIXELS = 112 * 112  # per frame: 16 tokens per temporal patch keeps every call fast
SMALL = ["--set", f"video.min_pixels={PIXELS}", "--max-pixels", str(PIXELS)]
HALF_LINE = '{"id": "lvbfix001_0", "task": "longvideobench_val_v", "mo'


@pytest.fixture(scope="module")
def lvb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 LongVideoBench questions, plus one on a corrupt video (second) and one on a missing
    video (last)."""
    root = make_eval_fixtures("longvideobench", tmp_path_factory.mktemp("lvb")).parent
    (root / "videos" / "garbage.mp4").write_bytes(bytes(range(256)) * 64)
    path = root / "lvb_val.json"
    entries = json.loads(path.read_text())
    garbage = {**entries[0], "id": "garbage_0", "video_path": "garbage.mp4"}
    missing = {**entries[1], "id": "missing_0", "video_path": "missing.mp4"}
    path.write_text(json.dumps([entries[0], garbage, *entries[1:], missing]))
    return root


@pytest.fixture(scope="module")
def vnb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One question per category (12 samples), plus 4 tries of a question on a missing video."""
    root = make_eval_fixtures("vnbench", tmp_path_factory.mktemp("vnb"),
                              types=("ret_insert1", "ord_edit1", "cnt_edit2")).parent
    return add_vnbench_tries(root, "gone_cnt_insert1.mp4", "cnt_insert1")


class Interrupting:
    """The engine, but Ctrl-C (KeyboardInterrupt, on every rank alike) at generate call ``at``
    (1-based): the sample in flight is lost, as with a real kill."""

    def __init__(self, engine: Engine, at: int):
        self.engine, self.at, self.calls = engine, at, 0

    def generate(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.engine.generate(*args, **kwargs)

    def request(self, *args, **kwargs):
        return self.engine.request(*args, **kwargs)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _rank_job(info: DistInfo, cfg: RuntimeConfig, lvb: str, vnb: str, out: str) -> dict:
    engine = Engine(cfg, info)
    out_dir = Path(out)
    stream = io.StringIO()
    report: dict = {}

    def lvb_spec(name: str) -> EvalSpec:
        return EvalSpec("longvideobench", lvb, str(out_dir / name), compare="exact",
                        max_new_tokens=4, skip_missing=True)

    report["lvb_whole"] = run_eval(lvb_spec("lvb_whole.jsonl"), cfg, lambda: engine,
                                   progress=stream)
    # Calls: sample 1 (2 calls), the corrupt video (1), sample 3 (2), then Ctrl-C on call 6,
    # the first of sample 4.
    try:
        run_eval(lvb_spec("lvb_cut.jsonl"), cfg, lambda: Interrupting(engine, 6),
                 progress=stream)
    except KeyboardInterrupt:
        report["interrupted"] = True
    if info.rank == 0:
        report["lvb_cut_lines"] = _lines(out_dir / "lvb_cut.jsonl")
        with open(out_dir / "lvb_cut.jsonl", "a") as f:  # a crash in the middle of a write
            f.write(HALF_LINE)
    comm.barrier()
    report["lvb_resumed"] = run_eval(lvb_spec("lvb_cut.jsonl"), cfg, lambda: engine,
                                     progress=stream)

    def vnb_spec(name: str, limit: int | None = None) -> EvalSpec:
        return EvalSpec("vnbench", vnb, str(out_dir / name), limit=limit, skip_missing=True)

    report["vnb_whole"] = run_eval(vnb_spec("vnb_whole.jsonl"), cfg, lambda: engine,
                                   progress=stream)
    report["vnb_limit"] = run_eval(vnb_spec("vnb_cut.jsonl", limit=6), cfg, lambda: engine,
                                   progress=stream)
    report["vnb_resumed"] = run_eval(vnb_spec("vnb_cut.jsonl"), cfg, lambda: engine,
                                     progress=stream)
    report["progress"] = stream.getvalue()
    return report


@pytest.fixture(scope="module")
def runs(tiny_config: RuntimeConfig, lvb: Path, vnb: Path,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("out")
    cfg = dataclasses.replace(tiny_config, video=dataclasses.replace(
        tiny_config.video, min_pixels=PIXELS, max_pixels=PIXELS))
    reports = spawn_local(_rank_job, 2, (cfg, str(lvb), str(vnb), str(out)),
                          timeout_s=400, collective_timeout_s=120)
    return out, reports


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _without_timing(path: Path) -> list[str]:
    return [json.dumps({k: v for k, v in r.items() if k != "timing"}) for r in _rows(path)]


def _comparable(results: dict) -> dict:
    return {k: v for k, v in results.items() if k not in ("date", "config")}


def test_only_rank_0_writes_and_reports(runs: tuple[Path, list[dict]]) -> None:
    out, (rank0, rank1) = runs
    assert rank0["interrupted"] and rank1["interrupted"]
    assert all(rank1[k] is None for k in rank1 if k.startswith(("lvb_", "vnb_")))
    assert rank1["progress"] == ""
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"{stem}{suffix}" for stem in ("lvb_whole", "lvb_cut", "vnb_whole", "vnb_cut")
        for suffix in (".jsonl", "_results.json", "_settings.json"))  # no lock file left
    progress = rank0["progress"]
    assert "longvideobench_val_v, mode spava on 2 rank(s): 6 samples, 0 already in" in progress
    # "agree" shows only once a pair has two letters: the random tiny model rarely gives one.
    assert re.search(r"\[6/6\] 100\.0%  eta 0:00:00  acc [\d.]+  errors 2", progress)
    assert f"dropped a half-written last line of {out / 'lvb_cut.jsonl'} ({len(HALF_LINE)} " \
           f"bytes)" in progress
    # The resumed run retries the corrupt video's sample (failed before) and the missing one.
    assert "6 samples, 2 already in" in progress and "4 to run, 1 failed before" in progress
    assert "1 with missing videos recorded as failed" in progress
    assert "16 samples, 6 already in" in progress


def test_longvideobench_rows_errors_and_comparison(runs: tuple[Path, list[dict]],
                                                   lvb: Path) -> None:
    out, (rank0, _) = runs
    rows = _rows(out / "lvb_whole.jsonl")
    ids = [e["id"] for e in json.loads((lvb / "lvb_val.json").read_text())]
    assert [r["id"] for r in rows] == ids
    garbage, missing = rows[1], rows[5]
    assert "garbage.mp4" in garbage["error"] and "cannot be read by decord" in garbage["error"]
    assert "missing.mp4" in missing["error"] and "does not exist" in missing["error"]
    for r in (garbage, missing):
        assert (r["pred"], r["parsed_pred"], r["correct"], r["exact"], r["timing"]) == \
               ("", None, False, None, None)
    good = [r for r in rows if r["error"] is None]
    assert len(good) == 4
    for r in good:
        assert r["mode"] == "spava" and 1 <= len(r["token_ids"]) <= 4
        assert r["frames"] == 16 and r["context_len"] > 128 and r["timing"]["ttft_s"] > 0
        assert r["correct"] == (r["parsed_pred"] == r["gt"])
        e = r["exact"]
        assert e["error"] is None and 1 <= len(e["token_ids"]) <= 4
        assert e["same_tokens"] == (e["token_ids"] == r["token_ids"])
        letters = (e["parsed_pred"], r["parsed_pred"])
        assert e["same_letter"] == (None if None in letters else letters[0] == letters[1])
    results = rank0["lvb_whole"]
    assert results["results"]["longvideobench_val_v"]["lvb_acc,none"] == \
        sum(r["correct"] for r in rows) / 6  # failed samples count, as wrong
    compare = results["apbv"]["compare_exact"]
    assert compare["compared"] == 4
    assert compare["token_agreement"] == sum(r["exact"]["same_tokens"] for r in good) / 4
    assert results["config"]["apbv"]["world_size"] == 2
    assert json.loads((out / "lvb_whole_results.json").read_text()) == results


def test_killed_then_resumed_equals_uninterrupted(runs: tuple[Path, list[dict]]) -> None:
    out, (rank0, _) = runs
    assert rank0["lvb_cut_lines"] == 3  # Ctrl-C lost only the sample in flight
    assert _without_timing(out / "lvb_cut.jsonl") == _without_timing(out / "lvb_whole.jsonl")
    assert _comparable(rank0["lvb_resumed"]) == _comparable(rank0["lvb_whole"])
    assert _without_timing(out / "vnb_cut.jsonl") == _without_timing(out / "vnb_whole.jsonl")
    assert _comparable(rank0["vnb_resumed"]) == _comparable(rank0["vnb_whole"])


def test_vnbench_rows_limit_and_four_try_scoring(runs: tuple[Path, list[dict]]) -> None:
    out, (rank0, _) = runs
    rows = _rows(out / "vnb_whole.jsonl")
    assert len(rows) == 16 and [r["try"] for r in rows] == [0, 1, 2, 3] * 4
    assert all(r["question_id"] == r["id"] == f"{Path(r['video']).stem}_{r['type']}_{r['try']}"
               for r in rows)
    assert all("gone_cnt_insert1.mp4" in r["error"] for r in rows[12:])
    assert all(r["error"] is None and 1 <= len(r["token_ids"]) <= 5 for r in rows[:12])
    limited = rank0["vnb_limit"]
    assert limited["n-samples"]["vnbench"] == {"original": 16, "effective": 6}
    assert limited["apbv"]["scores"]["incomplete_questions"] == 1
    scores = rank0["vnb_whole"]["apbv"]["scores"]
    assert scores["questions"] == 4 and scores["incomplete_questions"] == 0
    assert scores["types"]["cnt_insert1"] == {"questions": 1, "correct": 0, "acc": 0.0}
    for q in range(3):
        tries = rows[4 * q:4 * q + 4]
        assert scores["types"][tries[0]["type"]]["correct"] == all(r["correct"] for r in tries)


def test_eval_command_single_process(tiny_model_dir: Path, vnb: Path, tmp_path: Path,
                                     capsys) -> None:
    out = tmp_path / "cli.jsonl"
    args = ["eval", "--config", "tiny_cpu", "--model", str(tiny_model_dir), "--bench",
            "vnbench", "--data", str(vnb), "--out", str(out), "--limit", "4",
            "--max-new-tokens", "2", "--nframes", "8", *SMALL]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "vnbench: vnbench_acc " in captured.out and f"results: {tmp_path}" in captured.out
    assert "[4/4] 100.0%" in captured.err and _lines(out) == 4
    assert {r["frames"] for r in _rows(out)} == {8}  # --nframes replaces the preset's fps
    results = json.loads((tmp_path / "cli_results.json").read_text())
    assert results["config"]["apbv"]["world_size"] == 1
    assert main(args) == 0  # a finished run is only rescored
    assert "4 samples, 4 already in" in capsys.readouterr().err and _lines(out) == 4
    assert main([*args, "--mode", "exact"]) == 2
    assert "holds results of task vnbench in mode spava, not vnbench in mode exact" in \
        capsys.readouterr().err
    bad = ["eval", "--model", str(tiny_model_dir), "--bench", "vnbench", "--data",
           str(tmp_path / "none"), "--out", str(tmp_path / "x.jsonl")]
    assert main(bad) == 2
    assert "VNBench-main-4try.json' does not exist" in capsys.readouterr().err
    assert main(["make-eval-fixtures", "--bench", "longvideobench", "--out",
                 str(tmp_path / "fx"), "--count", "1"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "fx" / "lvb_val.json")


def test_eval_command_under_torchrun(tiny_model_dir: Path, lvb: Path, tmp_path: Path) -> None:
    out = tmp_path / "torchrun.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "apbv", "eval", "--config", "tiny_cpu", "--model", str(tiny_model_dir),
           "--bench", "longvideobench", "--data", str(lvb), "--out", str(out), "--limit", "2",
           "--max-new-tokens", "2", "--compare", "exact", *SMALL]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("longvideobench_val_v: lvb_acc ") == 1  # rank 0 only
    rows = _rows(out)
    assert [r["id"] for r in rows] == ["lvbfix000_0", "garbage_0"]
    results = json.loads((tmp_path / "torchrun_results.json").read_text())
    assert results["config"]["apbv"]["world_size"] == 2
    assert results["apbv"]["compare_exact"]["compared"] == 1
