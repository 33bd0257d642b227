"""The CPU rates as loaded now (:mod:`apbv.cost.calibrate`): probes that find a process gets
1/k of a core make every predicted second k times longer; ``plan --eval --hardware cpu``
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
from apbv.eval.forecast import SampleWork, forecast
from apbv.synthetic.eval_fixtures import make_eval_fixtures
from apbv.synthetic.videos import write_decode_probe

CPU = dataclasses.replace(cost.CPU, sample_overhead_s=0.002, sample_sync_s=0.0)


def _probes(slower: float) -> list[dict[str, float]]:
    """Two ranks' probes of a machine ``slower`` times the preset's."""
    return [{"host_share": 1.0 / slower}, {"host_share": 1.0 / slower}]


@pytest.fixture(scope="module")
def lvb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_eval_fixtures("longvideobench", tmp_path_factory.mktemp("lvb"), count=2).parent


def test_a_machine_k_times_slower_is_predicted_k_times_slower() -> None:
    loaded = calibrate.as_loaded(CPU, _probes(3.0))
    assert loaded.name == "cpu as loaded now (3.00x its times)"
    assert calibrate.slowdown(loaded, CPU) == pytest.approx(3.0)
    for name in calibrate.SECONDS_FIELDS:
        assert getattr(loaded, name) == pytest.approx(3.0 * getattr(CPU, name)), name
    for name in calibrate.RATE_FIELDS:
        assert getattr(loaded, name) == pytest.approx(getattr(CPU, name) / 3.0), name
    # every float constant is a rate, a time or one of the two ratios
    floats = {f.name for f in dataclasses.fields(CPU) if isinstance(getattr(CPU, f.name), float)}
    assert floats == {*calibrate.RATE_FIELDS, *calibrate.SECONDS_FIELDS, *calibrate.IO_FIELDS,
                      "thread_efficiency", "vision_elementwise_efficiency"}
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
    # the row's fsync is I/O: added per sample, the same on a loaded machine
    synced = dataclasses.replace(CPU, sample_sync_s=0.25)
    slow_synced = calibrate.as_loaded(synced, _probes(3.0))
    assert slow_synced.sample_sync_s == 0.25
    base, plus, slow_plus = (forecast(work, dims, hw, world_size=2, mode="spava",
                                      answer_tokens=4, groups=[1])[0]
                             for hw in (CPU, synced, slow_synced))
    assert plus.sample_s - base.sample_s == pytest.approx(0.25)
    assert slow_plus.sample_s == pytest.approx(3.0 * base.sample_s + 0.25, rel=1e-9)
    with pytest.raises(ValueError, match="as_loaded needs at least one probe"):
        calibrate.as_loaded(CPU, [])
    with pytest.raises(ValueError, match=r"share of a core must be in \(0, 1\], got 0.0"):
        calibrate.as_loaded(CPU, [{"host_share": 0.0}])


def test_probe_measures_a_share_of_a_core(tmp_path: Path) -> None:
    got = calibrate.probe(seconds=0.02)
    assert set(got) == {"host_share"} and 0 < got["host_share"] <= 1.05, got
    video = write_decode_probe(tmp_path)
    by_h = calibrate.calibrate_here(CPU, 2, seconds=0.05, rounds=3, video=video)  # two ranks
    assert sorted(by_h) == [1, 2], by_h  # groups of 2 ranks, and of 1
    for h, loaded in by_h.items():
        assert loaded.name.startswith("cpu as loaded now (") and loaded.layer_overhead_s == \
            pytest.approx(calibrate.slowdown(loaded, CPU) * CPU.layer_overhead_s)
        assert f"ms on {h} rank(s)" in loaded.name, loaded.name
    # measured on a gloo group of the two ranks, and on a process group of one (what a
    # collective adds to the work before it: 0 where the noise hides it)
    assert 0 <= by_h[2].link_latency_s < 1.0 and 0 <= by_h[1].solo_collective_s < 1.0, by_h
    assert by_h[2].solo_collective_s == 0.0 and by_h[1].link_latency_s == pytest.approx(
        calibrate.slowdown(by_h[1], CPU) * CPU.link_latency_s), by_h  # the other H's field
    # each rank's decoding of the probe video through apbv.video, as a rank of each H
    for loaded in by_h.values():
        assert 0 < loaded.video_open_s < 1.0 and 0 <= loaded.decode_frame_s < 1.0, loaded
        assert "a video open " in loaded.name, loaded.name
    one = calibrate.calibrate_here(CPU, 1, seconds=0.05, rounds=3)  # no group, no video
    assert list(one) == [1] and one[1].video_open_s == pytest.approx(
        calibrate.slowdown(one[1], CPU) * CPU.video_open_s), one  # the preset's, as loaded


def test_decoding_is_measured_beyond_the_pixels() -> None:
    hw = dataclasses.replace(CPU, decode_s_per_pixel=1e-8)
    measured = {"open_s": 0.004, "frames_s": 0.016, "frames": 8.0, "pixels": 12544.0}
    got = calibrate.with_decoding(hw, measured)
    assert got.video_open_s == 0.004
    assert got.decode_frame_s == pytest.approx(0.002 - 1e-8 * 12544), got.decode_frame_s
    assert got.name == f"{hw.name}; a video open 4.00 ms, a frame 2.00 ms"
    # the pixels' rate covers it all: nothing is left per frame
    assert calibrate.with_decoding(hw, {**measured, "pixels": 1e6}).decode_frame_s == 0.0
    with pytest.raises(ValueError, match="measured decoding must read >= 1 frame"):
        calibrate.with_decoding(hw, {**measured, "frames": 0.0})
    # two ranks' measurements: the mean open and the mean seconds a frame
    two = calibrate.mean_decoding([measured, {**measured, "open_s": 0.002, "frames": 4.0}])
    assert two == {"open_s": pytest.approx(0.003), "frames_s": pytest.approx(0.003),
                   "frames": 1.0, "pixels": 12544.0}
    by_h = calibrate.loaded_groups(hw, _probes(2.0), {2: 1e-3, 1: 1e-4}, {1: measured})
    assert by_h[1].video_open_s == 0.004 and by_h[2].video_open_s == pytest.approx(
        2.0 * hw.video_open_s), by_h  # measured on groups of one rank only


def test_plan_eval_on_cpu_measures_the_machine_first(
        lvb: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    asked = []

    def calibrate_here(hw: cost.Hardware, processes: int,
                       video: str | None = None) -> dict[int, cost.Hardware]:
        assert video is not None and Path(video).is_file(), video  # the decoding's video
        asked.append(processes)
        return calibrate.loaded_groups(hw, _probes(2.0), {2: 2 * hw.link_latency_s,
                                                          1: 0.0})

    monkeypatch.setattr(calibrate, "calibrate_here", calibrate_here)
    args = ["plan", "--eval", "--bench", "longvideobench", "--data", str(lvb), "--world-size",
            "2", "--hardware", "cpu", "--preset", "qwen2.5-vl-3b", "--frames", "8"]

    def sample_s(out: str) -> list[float]:
        return [float(s) for s in re.findall(r"^\s+\d+\s+\d+\s+([\d.]+)", out, re.M)]

    assert main(args) == 0
    loaded = capsys.readouterr().out
    assert asked == [2], asked
    assert f"ranks of cpu as loaded now (2.00x its times); a collective " \
           f"{2e3 * CPU.link_latency_s:.2f} ms on 2, 0.00 ms on 1 rank(s)" in loaded, loaded
    assert main([*args, "--idle"]) == 0
    idle = capsys.readouterr().out
    assert asked == [2] and "ranks of cpu (" in idle, idle
    assert sample_s(loaded) == pytest.approx([2.0 * s for s in sample_s(idle)], rel=2e-3)


def test_eta_weights_read_the_config_not_the_processor(tiny_model_dir: Path) -> None:
    assert cost.config_dims(tiny_model_dir) == cost.checkpoint_dims(tiny_model_dir)
