"""apbv.cost's decode stage: seconds per decoded token counted by hand (weights, KV read,
one all-gather per layer, the token's broadcast), the answer's growing KV on the query rank,
and the ``plan`` command's time to the last token."""

from __future__ import annotations

import dataclasses

import pytest

from apbv import cost
from apbv.__main__ import main
from apbv.cost import Hardware, ModelDims, predict
from apbv.cost.decode import decode_s, decode_step_s
from apbv.cost.hardware import Machine
from apbv.cost.work import _weights
from apbv.modes import MODE_NAMES

# Sizes small enough to count by hand: q 8, k 4, v 4, o 8 per token; MLP 8 -> 16 -> 8.
SMALL = ModelDims(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16,
                  vocab=10, vision_depth=2, vision_hidden=8, vision_intermediate=16,
                  vision_heads=2, fullatt_blocks=1, video_start=cost.RELEASED_VIDEO_START)
# Only memory traffic costs time (1 B/ns), plus what a test turns on.
MEMORY_ONLY = Hardware(name="mem", matmul_flops=1e30, conv_flops=1e30, attention_flops=1e30,
                       attention_pair_s=0.0, memory_bw=1e9, link_bw=1e30, link_latency_s=0.0,
                       decode_s_per_pixel=0.0, process_s_per_pixel=0.0,
                       preprocess_fixed_s=0.0, tokenize_s_per_token=0.0, layer_overhead_s=0.0,
                       vision_layer_overhead_s=0.0, call_overhead_s=0.0, dtype_bytes=2)
QWEN_7B = cost.preset_dims("qwen2.5-vl-7b")
H200 = cost.hardware("h200")


def test_one_step_is_weights_kv_merge_and_head_by_hand() -> None:
    """One rank, memory-bound: each layer reads its weights (q 8x8, k 8x4, v 8x4, o 8x8,
    MLP 3 x 8x16 = 576 weights), the one row's activations, the KV it holds and the merge's
    partial; then the lm_head (8x10) and the argmax's fp32 logits."""
    m = Machine(MEMORY_ONLY, 2)
    held = 100
    rows = sum(d_in + d_out for d_in, d_out in SMALL.text_linears())  # one row in and out
    assert _weights(SMALL.text_linears()) == 576
    per_layer = 2 * (576 + rows) + held * 2 * 1 * 4 * 2 + 2 * 1 * 2 * 5 * 4
    head = 2 * (80 + 18) + 4 * 10
    assert decode_step_s(SMALL, m, [held], 1) == pytest.approx((2 * per_layer + head) * 1e-9)


def test_collectives_one_gather_per_layer() -> None:
    """Going from 1 to 2 ranks (same KV held) adds one all-gather per layer of one rank's
    fp32 partial row (Hq * (D + 1) * 4 bytes); nothing else but the wider merge (no token
    broadcast: every rank picks the token itself)."""
    hw = dataclasses.replace(MEMORY_ONLY, link_latency_s=1e-3, link_bw=1e6)
    m = Machine(hw, 2)
    partial = 2 * 5 * 4
    extra = SMALL.layers * (1e-3 + partial / 1e6 + 2 * partial * 1e-9)
    two, one = decode_step_s(SMALL, m, [50, 50], 2), decode_step_s(SMALL, m, [50], 1)
    assert two - one == pytest.approx(extra)


def test_host_overhead_adds_on_cpus_and_hides_on_gpus() -> None:
    m = Machine(MEMORY_ONLY, 2)
    device = decode_step_s(SMALL, m, [10], 1)
    per_layer = (device - decode_step_s(dataclasses.replace(SMALL, layers=0), m, [10], 1)) / 2
    for overlaps, want in ((False, device + 2 * 1e-3),
                           (True, device - 2 * per_layer + 2 * max(per_layer, 1e-3))):
        hw = dataclasses.replace(MEMORY_ONLY, layer_overhead_s=1e-3,
                                 host_overlaps_device=overlaps)
        assert decode_step_s(SMALL, Machine(hw, 2), [10], 1) == pytest.approx(want)


def test_the_slowest_rank_decides_and_the_answer_grows_the_query_rank() -> None:
    m = Machine(MEMORY_ONLY, 2)
    kv = 2 * SMALL.layers * 1 * 4 * 2 * 1e-9  # one token's K and V, all layers, in seconds
    step = decode_step_s(SMALL, m, [100, 100], 2)
    # Rank 1 holds more than the query rank will reach: the appended tokens cost nothing.
    assert decode_s(SMALL, m, [10, 100], 6, 2) == pytest.approx(5 * step)
    # The query rank holds the most: step i reads i + 1 more tokens' KV.
    assert decode_s(SMALL, m, [100, 10], 6, 2) == pytest.approx(5 * step + kv * (1 + 2 + 3 + 4 + 5))
    assert decode_s(SMALL, m, [100, 10], 1, 2) == 0.0
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="answer_tokens must be an integer >= 1"):
            decode_s(SMALL, m, [1], bad, 1)  # type: ignore[arg-type]


def test_7b_on_h200_is_host_bound_eager_and_weight_bound_without_host() -> None:
    """The 7B on 8 H200s at 92k tokens: an eager step is its layers' host overhead (28 x
    1.07 ms); without it (the host hidden, e.g. a graph-captured step) it is the weights'
    read (about 15 GB / 5.85 TB/s) plus 28 collective latencies."""
    p = _7b(128)
    host = QWEN_7B.layers * H200.layer_overhead_s
    assert host < p.decode_token_s < host * 1.05
    free = _7b(128, dataclasses.replace(H200, layer_overhead_s=0.0))
    weights = (QWEN_7B.layers * _weights(QWEN_7B.text_linears())
               + QWEN_7B.hidden * QWEN_7B.vocab) * 2 / H200.memory_bw
    assert weights < free.decode_token_s < weights + 28 * H200.link_latency_s + 1e-3
    # TTFT is the same as without decode; the last token adds the 127 steps.
    one = _7b(1)
    assert one.ttft_s == p.ttft_s and one.answer_tokens == 1
    assert one.seconds["decode"] == pytest.approx(p.seconds["decode"] - 127 * p.decode_token_s)
    assert p.last_token_s == pytest.approx(p.ttft_s + p.seconds["decode"])
    assert p.to_json()["last_token_s"] == p.last_token_s


def _7b(answer_tokens: int, hw: Hardware = H200) -> cost.Prediction:
    tokens = 720
    return predict("spava", QWEN_7B, context_len=QWEN_7B.video_start + 128 * tokens + 1,
                   query_len=64, world_size=8, frames=256, tokens_per_patch=tokens, hw=hw,
                   answer_tokens=answer_tokens)


def test_plan_command_prints_the_time_to_the_last_token(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--preset", "qwen2.5-vl-7b", "--hardware", "h200", "--world-size", "8",
            "--frames", "256", "--height", "1440", "--width", "2560"]
    assert main([*args, "--answer-tokens", "128"]) == 0
    out = capsys.readouterr().out
    assert "128-token answers" in out and "decode ms/tok" in out and "last token s" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in MODE_NAMES}
    assert set(rows) == set(MODE_NAMES)
    for row in rows.values():
        # the eager columns, then decode.graphs' three (tests/unit/test_cost_graphs.py)
        ttft, per_token, last = float(row[1]), float(row[-5]) / 1e3, float(row[-4])
        assert last == pytest.approx(ttft + 127 * per_token, abs=2e-3), row  # rounding
    assert main(args) == 0  # one-token answers: the table without the decode columns
    assert "last token s" not in capsys.readouterr().out
    assert main([*args, "--answer-tokens", "0"]) == 2
    assert "answer_tokens must be an integer >= 1" in capsys.readouterr().err
