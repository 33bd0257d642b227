"""The fixed cost of the engine's collectives in the cost model (:mod:`apbv.cost.control`): on
hardware where only a collective costs anything, every stage is its collectives as the engine
issues them (counted from its code) times the measured latency, on two ranks and on a
process group of one; the calibration's per-H hardware reaches ``forecast`` and ``plan
--eval``. Pure: the latencies are given."""

from __future__ import annotations

import pytest

from apbv import cost
from apbv.cost import Hardware, calibrate, control
from apbv.eval.forecast import SampleWork, forecast, predict_one

LATENCY, SOLO = 1e-3, 1e-4
ONLY_COLLECTIVES = Hardware(
    name="collectives only", matmul_flops=1e30, conv_flops=1e30, attention_flops=1e30,
    attention_pair_s=0.0, memory_bw=1e30, link_bw=1e30, link_latency_s=LATENCY,
    decode_s_per_pixel=0.0, process_s_per_pixel=0.0, preprocess_fixed_s=0.0,
    tokenize_s_per_token=0.0, layer_overhead_s=0.0, vision_layer_overhead_s=0.0,
    call_overhead_s=0.0, solo_collective_s=SOLO)
DIMS = cost.preset_dims("qwen2.5-vl-3b")


def _predict(ranks: int, answer_tokens: int = 4) -> cost.Prediction:
    context = DIMS.video_start + 4 * 48 + 1
    return cost.predict("spava", DIMS, hw=ONLY_COLLECTIVES, context_len=context, query_len=24,
                        world_size=ranks, frames=8, tokens_per_patch=48,
                        answer_tokens=answer_tokens)


@pytest.mark.parametrize("ranks", [2, 1])
def test_every_stage_is_its_collectives_times_the_latency(ranks: int) -> None:
    p = _predict(ranks)
    each = LATENCY if ranks > 1 else SOLO
    blocks = p.plan.blocks_per_rank
    assert blocks == 2  # ZigZag: two blocks on every rank
    # (collectives besides the closing barrier): the agreement; the agreement and the vision
    # cache's flag; the embeddings' all-to-all (one rank: a copy, no collective); per layer
    # one all-gather per block and the query's; the first token's broadcast; per decode
    # step one all-gather per layer
    counts = {"preprocess": 1, "vision": 2, "transfer": 1 if ranks > 1 else 0,
              "prefill": DIMS.layers * (blocks + 1), "first_token": 1,
              "decode": 3 * DIMS.layers}
    for stage, n in counts.items():
        assert p.seconds[stage] == pytest.approx((n + 1) * each, rel=1e-9), (stage, p.seconds)
    # outside the stages: the request's check, each stage's max over ranks and the KV bytes'
    assert control.bookkeeping_collectives(6) == 8
    assert p.bookkeeping_s == pytest.approx(8 * each, rel=1e-9)
    assert p.request_s == pytest.approx(p.last_token_s + 8 * each, rel=1e-12)
    one = _predict(ranks, answer_tokens=1)  # no decode step: the decode stage's barrier
    assert one.seconds["decode"] == pytest.approx(each, rel=1e-9)
    with pytest.raises(ValueError, match="stages must be an integer >= 0, got -1"):
        control.bookkeeping_collectives(-1)


def test_a_single_process_has_no_collective_cost() -> None:
    p = _predict(1)
    alone = cost.predict("spava", DIMS, hw=Hardware(**{**ONLY_COLLECTIVES.to_json(),
                                                       "solo_collective_s": 0.0}),
                         context_len=p.plan.context_len, query_len=24, world_size=1,
                         frames=8, tokens_per_patch=48, answer_tokens=4)
    assert alone.request_s < 1e-15 and p.request_s > 0.01, (alone.seconds, p.seconds)


def test_the_measured_latency_per_group_size_reaches_the_forecast() -> None:
    probes = [{"host_share": 0.5}, {"host_share": 0.5}]
    by_h = calibrate.loaded_groups(ONLY_COLLECTIVES, probes, {2: 3e-3, 1: 2e-4})
    assert sorted(by_h) == [1, 2]
    assert by_h[2].link_latency_s == 3e-3 and by_h[1].solo_collective_s == 2e-4
    assert by_h[2].name == "collectives only as loaded now (2.00x its times); a collective " \
                           "3.00 ms on 2 rank(s)", by_h[2].name
    with pytest.raises(ValueError, match=r"a collective's measured seconds must be in \[0, 60\)"):
        calibrate.with_collectives(ONLY_COLLECTIVES, 2, -1.0)
    work = [SampleWork(str(i), 8, (6, 8), DIMS.video_start + 4 * 48 + 1, 24) for i in range(3)]
    f1, f2 = forecast(work, DIMS, by_h, world_size=2, mode="spava", answer_tokens=4)
    assert f1.sample_s == pytest.approx(predict_one(work[0], DIMS, by_h[2], 2, "spava", 4))
    assert f2.sample_s == pytest.approx(predict_one(work[0], DIMS, by_h[1], 1, "spava", 4))
    # two groups: per round the slower group's sample and the rows' gather over the world
    # (two collectives of two ranks)
    assert f2.wall_s == pytest.approx(2 * (f2.sample_s + 2 * 3e-3), rel=1e-9)
    with pytest.raises(ValueError, match="no hardware measured for groups of 4 rank"):
        forecast(work, DIMS, by_h, world_size=4, mode="spava", answer_tokens=4, groups=[1])
