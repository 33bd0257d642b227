"""apbv.cost's decode with ``decode.graphs``: the owner's fp32 pass over its reserved buffer,
a replayed step without host dispatch, the capture paid once per KV bucket, short answers
left eager; the h100 preset derived from the H200's measurements; the calibration's add
counted by the tensors it moves; ``plan`` printing the last token with graphs on and off."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest

from apbv import cost
from apbv.__main__ import main
from apbv.cost import MIN_GRAPH_TOKENS, Hardware, ModelDims, graph_decode, predict
from apbv.cost.decode import decode_s, decode_step_s, graph_step_s, owner_pass_s
from apbv.cost.hardware import H100_HBM_BW, H200_HBM_BW, Machine
from apbv.modes import MODE_NAMES

ROOT = Path(__file__).resolve().parents[2]
# q 8, k 4, v 4, o 8 per token; one KV head of 4: 8 K and V elements per row and layer.
SMALL = ModelDims(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16,
                  vocab=10, vision_depth=2, vision_hidden=8, vision_intermediate=16,
                  vision_heads=2, fullatt_blocks=1, video_start=cost.RELEASED_VIDEO_START)
# Only memory traffic costs time (1 B/ns) and what a test turns on; a GPU-like host.
GPU_LIKE = Hardware(name="mem", matmul_flops=1e30, conv_flops=1e30, attention_flops=1e30,
                    attention_pair_s=0.0, memory_bw=1e9, link_bw=1e30, link_latency_s=0.0,
                    decode_s_per_pixel=0.0, process_s_per_pixel=0.0, preprocess_fixed_s=0.0,
                    tokenize_s_per_token=0.0, layer_overhead_s=1e-3,
                    vision_layer_overhead_s=0.0, call_overhead_s=0.0, dtype_bytes=2,
                    host_overlaps_device=True, graph_layer_s=1e-6, graph_capture_s=0.05)
M = Machine(GPU_LIKE, 2)
QWEN_7B = cost.preset_dims("qwen2.5-vl-7b")


def test_owner_pass_by_hand() -> None:
    """fp32 (as captured today): every reserved row's K and V read in bf16 (2 B), written and
    read as fp32 (4 + 4 B), and the (Hq, C) fp32 scores moved 4 times; a bf16 kernel reads
    the valid rows' K and V only."""
    valid, capacity = 100, 300
    fp32 = owner_pass_s(SMALL, M, valid, capacity, "fp32")
    assert fp32 == pytest.approx((capacity * 8 * (2 + 4 + 4) + 4 * capacity * 2 * 4) * 1e-9)
    assert owner_pass_s(SMALL, M, valid, capacity, "kernel") == pytest.approx(valid * 8 * 2e-9)
    with pytest.raises(ValueError, match="owner_pass must be one of fp32, kernel; got 'bf16'"):
        owner_pass_s(SMALL, M, valid, capacity, "bf16")


def test_replayed_step_drops_the_host_and_adds_the_owner_pass() -> None:
    """Eager, the 1 ms host dispatch per layer hides the device work; replayed, a layer is its
    device work with the owner's attention swapped for its pass, plus graph_layer_s."""
    held, capacity = [40, 100], 200  # rank 0 owns the buffer; rank 1 holds more valid rows
    eager = decode_step_s(SMALL, M, held, 2)
    head = decode_step_s(dataclasses.replace(SMALL, layers=0), M, held, 2)
    assert eager == pytest.approx(SMALL.layers * 1e-3 + head)  # host-bound
    device = decode_step_s(SMALL, Machine(dataclasses.replace(GPU_LIKE, layer_overhead_s=0.0),
                                          2), held, 2)
    rank1_kv = 100 * 8 * 2e-9
    owner = owner_pass_s(SMALL, M, 40, capacity)
    assert owner > rank1_kv  # the fp32 pass over 200 rows outweighs rank 1's 100 bf16 rows
    want = device + SMALL.layers * (owner - rank1_kv + 1e-6)
    assert graph_step_s(SMALL, M, held, 2, capacity) == pytest.approx(want)
    kernel = graph_step_s(SMALL, M, held, 2, capacity, owner_pass="kernel")
    assert kernel == pytest.approx(device + SMALL.layers * 1e-6)  # rank 1's read decides


def test_capture_once_per_bucket_and_short_answers_stay_eager() -> None:
    cached = [50, 20]  # the owner's pass does not depend on its valid rows: constant replays
    answer = MIN_GRAPH_TOKENS  # the shortest answer that is captured
    g = graph_decode(SMALL, M, cached, answer, 2)
    steps = answer - 1
    replay = graph_step_s(SMALL, M, [51, 20], 2, 50 + steps)
    first = decode_step_s(SMALL, M, [51, 20], 2)
    assert g.captured and g.token_s == pytest.approx(replay)
    assert g.capture_s == pytest.approx(2 * first + 0.05 + replay)  # + the check's all-reduce
    assert g.first_s == pytest.approx(first + g.capture_s + (steps - 1) * replay)
    assert g.reused_s == pytest.approx(steps * replay)
    assert g.reused_s < decode_s(SMALL, M, cached, answer, 2) < g.first_s  # 15 steps: no gain
    short = graph_decode(SMALL, M, cached, answer - 1, 2)
    eager = decode_s(SMALL, M, cached, answer - 1, 2)
    assert not short.captured and short.capture_s == 0.0
    assert short.first_s == short.reused_s == pytest.approx(eager)
    assert graph_decode(SMALL, M, cached, 1, 2).first_s == 0.0
    big = graph_decode(SMALL, M, cached, answer, 2, capacity=1000)  # a bucket rounded up
    assert big.token_s > g.token_s
    with pytest.raises(ValueError, match=r"capacity \(60\) must hold the 50 cached rows and "
                                         r"the 15 decode steps"):
        graph_decode(SMALL, M, cached, answer, 2, capacity=60)


def test_h100_is_the_h200_with_the_h100s_memory() -> None:
    h100, h200 = cost.hardware("h100"), cost.hardware("h200")
    assert h100.memory_bw == pytest.approx(h200.memory_bw * 3.35 / 4.8, rel=1e-3)
    assert (H100_HBM_BW, H200_HBM_BW) == (3.35e12, 4.8e12)
    same = {k: v for k, v in h100.to_json().items()
            if k not in ("name", "memory_bw", "attention_kernel")}
    assert same == {k: v for k, v in h200.to_json().items() if k in same}
    assert "H200" in h100.attention_kernel and h100.name == "h100"
    assert Hardware.from_json(h100.to_json()) == h100
    # The re-derived H200 bandwidth is under the spec (the old a + a reading was over it).
    assert 0.7 * H200_HBM_BW < h200.memory_bw < H200_HBM_BW
    assert 0.7 * H100_HBM_BW < h100.memory_bw < H100_HBM_BW


def test_calibration_counts_the_tensors_its_add_moves() -> None:
    """The committed H200 file timed ``a + a`` (one read, one write: 4 bytes per bf16
    element over the time); a file recording ``add_streams`` 3 (``torch.add(a, b, out=c)``)
    counts 6; the preset is what the committed file derives to."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import calibrate_gpu
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    report = json.loads((ROOT / "benchmarks/results/h200_calibration.json").read_text())
    measured, setup = report["measurements"], report["setup"]
    streams = calibrate_gpu.add_streams(measured)
    assert streams == measured.get("add_streams", 2)  # 2: the committed run's a + a
    old = calibrate_gpu.derive(measured, setup, "h200")
    elements = setup["sizes"]["add_elements"]
    assert old.memory_bw == pytest.approx(streams * 2 * elements / measured["add_s"], rel=1e-3)
    assert old == cost.hardware("h200")
    three = calibrate_gpu.derive({**measured, "add_streams": 3}, setup, "h200")
    assert three.memory_bw == pytest.approx(3 / streams * old.memory_bw, rel=1e-3)
    # The tower's elementwise share is refitted against the bandwidth: the same bytes/s.
    assert (three.memory_bw * three.vision_elementwise_efficiency
            == pytest.approx(old.memory_bw * old.vision_elementwise_efficiency, rel=2e-3))


def test_7b_on_8_h100_graphs_against_eager() -> None:
    """256 frames of 1440p (N = 92,176), 8 ranks, 128 tokens: a replayed step is bound by the
    weights' read at the H100's bandwidth, the eager one by the host; the runtime's bf16 owner
    kernel is priced, and the fp32 fallback pass would cost 10-30% more per replayed step."""
    h100 = cost.hardware("h100")
    tokens = 720
    args = dict(context_len=QWEN_7B.video_start + 128 * tokens + 1, query_len=64,
                world_size=8, frames=256, tokens_per_patch=tokens, hw=h100,
                answer_tokens=128)
    p = predict("spava", QWEN_7B, **args)
    assert p.graphs is not None and p.graphs.captured
    weights = 15.2e9 / h100.memory_bw
    assert weights < p.graphs.token_s < 1.6 * weights, p.graphs
    assert p.decode_token_s > 3 * p.graphs.token_s, (p.decode_token_s, p.graphs.token_s)
    assert 0.05 < p.graphs.capture_s < 0.15, p.graphs.capture_s
    assert p.last_token_graphs_s == pytest.approx(p.ttft_s + p.graphs.first_s)
    assert p.last_token_graphs_s < p.last_token_s
    assert p.to_json()["graphs"]["capture_s"] == p.graphs.capture_s
    m = Machine(h100, 2)
    cached = [r.cached_tokens for r in p.ranks]
    kernel = graph_decode(QWEN_7B, m, cached, 128, 8, owner_pass="kernel").token_s
    assert p.graphs.token_s == pytest.approx(kernel)  # the runtime's bundled flash kernel
    fp32 = graph_decode(QWEN_7B, m, cached, 128, 8, owner_pass="fp32").token_s
    extra = fp32 / kernel - 1
    assert 0.10 < extra < 0.30, f"fp32 owner pass +{extra:.1%} per token"
    assert predict("spava", QWEN_7B, **{**args, "hw": cost.CPU}).graphs is None


def test_plan_prints_the_last_token_with_graphs_on_and_off(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--preset", "qwen2.5-vl-7b", "--hardware", "h100", "--world-size", "8",
            "--frames", "256", "--answer-tokens", "128"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "rates assumed on h100: matmul 759 TFLOP/s, attention 321 TFLOP/s (PyTorch SDPA " \
           "measured on NVIDIA H200" in out and "memory 2.72 TB/s" in out, out
    assert "decode eager and with decode.graphs" in out
    lines = out.splitlines()
    head = next(line for line in lines if line.startswith("mode "))
    assert head.split("KV GiB/rank")[1].split() == [
        "decode", "ms/tok", "last", "token", "s", "graph", "ms/tok", "capture", "s", "last",
        "graphs", "s"], head
    rows = {line.split()[0]: line.split() for line in lines
            if line.split() and line.split()[0] in MODE_NAMES}
    assert set(rows) == set(MODE_NAMES)
    for row in rows.values():
        ttft = float(row[1])
        eager, last, graph, capture, last_graphs = (float(x) for x in row[-5:])
        assert last == pytest.approx(ttft + 127 * eager / 1e3, abs=2e-3), row
        assert last_graphs == pytest.approx(ttft + 127 * graph / 1e3 + capture
                                            + (eager - graph) / 1e3, abs=3e-3), row
        assert graph < eager / 3 and last_graphs < last, row
    later = re.search(r"a later one replays every step: last token ([\d.]+) s \(spava\)", out)
    spava = rows["spava"]
    assert later and float(spava[1]) < float(later.group(1)) < float(spava[-1]), out
    assert float(later.group(1)) == pytest.approx(float(spava[-1]) - float(spava[-2])
                                                  - (float(spava[-5]) - float(spava[-3])) / 1e3,
                                                  abs=3e-3), out
    assert main([*args[:-1], "8"]) == 0  # 7 steps: too short to capture
    out = capsys.readouterr().out
    assert "too short to capture (eager decode)" in out
    assert main([*args[:4], "cpu", *args[5:]]) == 0  # no CUDA graphs: eager columns only
    out = capsys.readouterr().out
    assert "no decode graphs (eager)" in out and "graph ms/tok" not in out
