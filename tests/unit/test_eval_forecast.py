"""Choosing G and the run's progress: ``plan --eval`` predicts every split's wall time from the
cost model and recommends the least; the forecast's wall time is its rounds' slowest samples;
the progress ETA is the cost model's seconds left scaled by the measured ratio, rewritten in
place on a terminal and plain lines in a log; ``apbv eval`` exits 0 with failed rows (counted)
unless ``--fail-on-error``."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from apbv import cost
from apbv.__main__ import main
from apbv.eval import report
from apbv.eval.data import load_samples
from apbv.eval.forecast import (
    divisors,
    forecast,
    predict_one,
    recommend,
    round_gather_s,
    sample_work,
)
from apbv.eval.groups import deal
from apbv.synthetic.eval_fixtures import make_eval_fixtures
from tests.unit.test_eval_loop import ScriptedEngine, scripted_engine, vnbench_fixture


@pytest.fixture(scope="module")
def lvb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_eval_fixtures("longvideobench", tmp_path_factory.mktemp("lvb"), count=6).parent


def test_forecast_is_the_rounds_slowest_samples(lvb: Path) -> None:
    dims, hw = cost.preset_dims("qwen2.5-vl-7b"), cost.hardware("h200")
    work = sample_work(load_samples("longvideobench", lvb), dims, {"nframes": 32})
    assert len(work) == 6 and {w.frames for w in work} == {32}
    assert all(w.context_len > 32 // 2 * w.grid[0] * w.grid[1] for w in work)
    forecasts = forecast(work, dims, hw, world_size=8, mode="spava", answer_tokens=2)
    assert [(f.groups, f.ranks) for f in forecasts] == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    for f in forecasts:
        seconds = [predict_one(w, dims, hw, f.ranks, "spava", 2) for w in work]
        dealt = deal(seconds, f.groups)
        gather = round_gather_s(hw, 8) if f.groups > 1 else 0.0  # the rows meet on rank 0
        rounds = [max(seconds[d[r]] for d in dealt if r < len(d)) + gather
                  for r in range(max(map(len, dealt)))]
        assert f.wall_s == pytest.approx(sum(rounds), rel=1e-12)
        assert gather == (2 * hw.link_latency_s if f.groups > 1 else 0.0)
        assert f.sample_s == pytest.approx(sum(seconds) / 6, rel=1e-12)
    best = recommend(forecasts)
    assert best.wall_s == min(f.wall_s for f in forecasts)
    # 32 frames are 16 temporal patches: one group of 32 ranks cannot split them
    wide = forecast(work, dims, hw, world_size=32, mode="spava", answer_tokens=2, groups=[1, 2])
    assert "16 temporal patches" in (wide[0].why_not or "") and wide[0].wall_s == float("inf")
    assert wide[1].why_not is None and recommend(wide) is wide[1]


def test_plan_eval_prints_every_split_and_the_recommendation(
        lvb: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--eval", "--bench", "longvideobench", "--data", str(lvb),
                 "--world-size", "8", "--hardware", "h200", "--frames", "32"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+[\d.]+\s+\S+( s)?\s+[\d.]+", out, re.M)
    assert [(g, h) for g, h, _ in rows] == [("1", "8"), ("2", "4"), ("4", "2"), ("8", "1")], out
    assert re.search(r"recommended on h200: --groups \d ", out), out
    assert main(["plan", "--eval", "--data", str(lvb)]) == 2
    assert "plan --eval needs --bench and --data" in capsys.readouterr().err


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_eta_from_the_cost_model_on_a_terminal_and_in_a_log(monkeypatch) -> None:
    clock = iter([100.0, 102.0, 104.0])
    monkeypatch.setattr(report.time, "monotonic", lambda: next(clock))
    row = {"correct": True, "error": None}
    tty = Terminal()
    progress = report.Progress(tty, 3, [], False, predicted={"a": 1.0, "b": 3.0, "c": 4.0})
    progress.update({**row, "id": "a"})
    assert progress.eta_s() == pytest.approx(4.0 * 7.0 / 1.0)  # 2 s measured for 1 predicted
    progress.close()
    assert tty.getvalue() == "\r[1/3] 33.3%  eta 0:00:14  acc 1.000\x1b[K\n"
    log = io.StringIO()
    monkeypatch.setattr(report.time, "monotonic", iter([0.0, 5.0]).__next__)
    plain = report.Progress(log, 2, [], False)
    plain.update({**row, "id": "a"})
    plain.close()
    assert log.getvalue() == "[1/2] 50.0%  eta 0:00:05  acc 1.000\n"


class Engine(ScriptedEngine):
    """The scripted engine with the family's system turn accepted."""

    @staticmethod
    def request(video: str, question: str, *, mode: str, max_new_tokens: int, **_):
        return (video, question, mode, max_new_tokens)


def test_eval_exits_0_with_failed_rows_unless_fail_on_error(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    root = vnbench_fixture(tmp_path / "vnb")
    script = scripted_engine(root)
    monkeypatch.setattr("apbv.engine.engine.Engine",
                        lambda cfg, info: Engine(script.answers))
    args = ["eval", "--bench", "vnbench", "--data", str(root), "--model", str(tiny_model_dir),
            "--out", str(tmp_path / "out.jsonl")]
    assert main(args) == 0
    out = capsys.readouterr()
    assert "(12 samples, 4 failed, 1 unparsed)" in out.out, out.out
    assert "[12/12] 100.0%" in out.err and "cost model's ETA weights" in out.err, out.err
    assert main([*args, "--fail-on-error"]) == 1  # the 4 failed samples run again, and fail
    assert main([*args, "--groups", "2"]) == 2
    assert "groups=2 does not divide the world of 1" in capsys.readouterr().err
