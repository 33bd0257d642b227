"""The CPU rates as loaded now (:mod:`apbv.cost.calibrate`): probes that find the machine k
times slower make every predicted second k times longer; ``plan --eval --hardware cpu``
measures first (``--idle`` does not); the eval's ETA weights read the checkpoint's sizes
without its processor. No timing is asserted: the probes are given."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from apbv import cost
from apbv.__main__ import main
from apbv.cost import calibrate
from apbv.eval.fixtures import make_eval_fixtures
from apbv.eval.forecast import SampleWork, forecast

CPU = dataclasses.replace(cost.CPU, sample_overhead_s=0.002)


def _probes(slower: float, link: bool = True) -> list[dict[str, float]]:
    """Two ranks' probes of a machine ``slower`` times the preset's (memory and link too)."""
    probe = {"matmul_flops": CPU.matmul_flops / slower, "memory_bw": CPU.memory_bw / slower}
    if link:
        probe["link_latency_s"] = CPU.link_latency_s * slower
    return [probe, dict(probe)]


@pytest.fixture(scope="module")
def lvb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_eval_fixtures("longvideobench", tmp_path_factory.mktemp("lvb"), count=2).parent


def test_a_machine_k_times_slower_is_predicted_k_times_slower() -> None:
    loaded = calibrate.as_loaded(CPU, _probes(3.0))
    assert loaded.name == "cpu as loaded now (3.00x its times)"
    assert calibrate.slowdown(loaded, CPU) == pytest.approx(3.0)
    for name in calibrate.HOST_FIELDS:
        assert getattr(loaded, name) == pytest.approx(3.0 * getattr(CPU, name)), name
    for name in calibrate.RATE_FIELDS:
        assert getattr(loaded, name) == pytest.approx(getattr(CPU, name) / 3.0), name
    dims = cost.preset_dims("qwen2.5-vl-3b")
    work = [SampleWork(str(i), 8, (6, 8), cost.video_context_len(dims, 4, (6, 8)), 20 + i)
            for i in range(3)]
    for ranks in (1, 2):
        idle, slow = (forecast(work, dims, hw, world_size=2, mode="spava", answer_tokens=4,
                               groups=[2 // ranks])[0] for hw in (CPU, loaded))
        assert slow.wall_s == pytest.approx(3.0 * idle.wall_s, rel=1e-9), (ranks, slow, idle)
    # the harness's seconds per sample are part of each sample's
    more = dataclasses.replace(CPU, sample_overhead_s=CPU.sample_overhead_s + 0.5)
    one, two = (forecast(work, dims, hw, world_size=2, mode="spava", answer_tokens=4,
                         groups=[1])[0] for hw in (CPU, more))
    assert two.sample_s - one.sample_s == pytest.approx(0.5)
    assert two.wall_s - one.wall_s == pytest.approx(0.5 * len(work))
    # a probe without a link measurement keeps the preset's latency
    assert calibrate.as_loaded(CPU, _probes(2.0, link=False)).link_latency_s == \
        CPU.link_latency_s
    with pytest.raises(ValueError, match="as_loaded needs at least one probe"):
        calibrate.as_loaded(CPU, [])


def test_probe_measures_positive_rates() -> None:
    got = calibrate.probe(seconds=0.01)
    assert set(got) == {"matmul_flops", "memory_bw"}
    assert all(v > 0 for v in got.values()), got


def test_plan_eval_on_cpu_measures_the_machine_first(
        lvb: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    asked = []

    def calibrate_here(hw: cost.Hardware, processes: int) -> cost.Hardware:
        asked.append(processes)
        return calibrate.as_loaded(hw, _probes(2.0))

    monkeypatch.setattr(calibrate, "calibrate_here", calibrate_here)
    args = ["plan", "--eval", "--bench", "longvideobench", "--data", str(lvb), "--world-size",
            "2", "--hardware", "cpu", "--preset", "qwen2.5-vl-3b", "--frames", "8"]

    def sample_s(out: str) -> list[float]:
        return [float(s) for s in re.findall(r"^\s+\d+\s+\d+\s+([\d.]+)", out, re.M)]

    assert main(args) == 0
    loaded = capsys.readouterr().out
    assert asked == [2] and "ranks of cpu as loaded now (2.00x its times)" in loaded, loaded
    assert main([*args, "--idle"]) == 0
    idle = capsys.readouterr().out
    assert asked == [2] and "ranks of cpu (" in idle, idle
    assert sample_s(loaded) == pytest.approx([2.0 * s for s in sample_s(idle)], rel=2e-3)


def test_eta_weights_read_the_config_not_the_processor(tiny_model_dir: Path) -> None:
    assert cost.config_dims(tiny_model_dir) == cost.checkpoint_dims(tiny_model_dir)
