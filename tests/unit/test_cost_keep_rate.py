"""The cost model's keep rate (``Workload.keep_rate``, ``plan --keep-rate``/``--pruning-rate``):
whole temporal patches pruned before the tower cost what an unpruned video of the kept patches
costs in every stage after preprocessing (whose frames are all still decoded); tokens pruned
after the tower leave the tower's work whole and shrink the rest."""

from __future__ import annotations

import dataclasses

import pytest

from apbv import cost
from apbv.__main__ import main
from apbv.cost import Workload, estimate
from apbv.modes import get_mode

QWEN_7B = cost.preset_dims("qwen2.5-vl-7b")
INTERNVL = cost.preset_dims("internvl3-2b")
AFTER_PREPROCESS = ("vision", "transfer", "prefill", "first_token", "decode")


def _work(dims: cost.ModelDims, patches: int, grid: tuple[int, int], **fields) -> Workload:
    return Workload.of(dims, context_len=cost.video_context_len(dims, patches, grid),
                       query_len=32, world_size=4, frames=patches * dims.temporal_patch_size,
                       grid=grid, answer_tokens=8, **fields)


@pytest.mark.parametrize("dims, grid", [(QWEN_7B, (16, 24)), (INTERNVL, (16, 16))],
                         ids=["qwen2.5-vl", "internvl3"])
@pytest.mark.parametrize("mode", ["spava", "no_vit_split", "full"])
def test_halving_the_keep_rate_prices_the_kept_patches(dims, grid, mode) -> None:
    hw, spec = cost.hardware("h200"), get_mode(mode)
    whole = estimate(spec, dims, _work(dims, 128, grid), hw)
    prefill = {1.0: whole.seconds["prefill"]}
    for rate, kept in ((0.5, 64), (0.25, 32)):
        pruned = estimate(spec, dims, _work(dims, 128, grid, keep_rate=rate), hw)
        same = estimate(spec, dims, _work(dims, kept, grid), hw)  # a video of the kept patches
        assert pruned.plan == same.plan and pruned.keep_rate == rate
        for stage in AFTER_PREPROCESS:
            assert pruned.seconds[stage] == pytest.approx(same.seconds[stage], rel=1e-12), stage
        assert [r.kv_bytes for r in pruned.ranks] == [r.kv_bytes for r in same.ranks]
        # every frame is still decoded (and judged): more than the kept video's preprocess
        assert pruned.seconds["preprocess"] > same.seconds["preprocess"]
        prefill[rate] = pruned.seconds["prefill"]
    # halving the kept tokens more than halves the attention and at most halves the rest
    assert prefill[1.0] > prefill[0.5] > prefill[0.25], prefill


def test_pruning_after_the_tower_keeps_the_towers_work() -> None:
    hw, spec, grid = cost.hardware("cpu"), get_mode("spava"), (16, 24)
    whole = estimate(spec, QWEN_7B, _work(QWEN_7B, 64, grid), hw)
    pruned = estimate(spec, QWEN_7B, _work(QWEN_7B, 64, grid, keep_rate=0.25, keep_by="token"),
                      hw)
    assert pruned.seconds["vision"] == whole.seconds["vision"]
    assert [r.vision_flops for r in pruned.ranks] == [r.vision_flops for r in whole.ranks]
    dropped = 64 * (16 * 24 - 96)  # each patch keeps 96 of its 384 tokens
    assert pruned.plan.context_len == whole.plan.context_len - dropped
    assert pruned.seconds["prefill"] < 0.5 * whole.seconds["prefill"]
    patch = estimate(spec, QWEN_7B, _work(QWEN_7B, 64, grid, keep_rate=0.25), hw)
    assert patch.plan.context_len == pruned.plan.context_len
    assert patch.seconds["vision"] < 0.5 * pruned.seconds["vision"]


def test_keep_rate_errors() -> None:
    for bad in (0, 0.0, 1.5, -0.1, True):
        with pytest.raises(ValueError, match=r"keep_rate must be a fraction in \(0, 1\]"):
            _work(QWEN_7B, 8, (4, 4), keep_rate=bad)
    with pytest.raises(ValueError, match="keep_by must be one of patch, token, got 'frame'"):
        _work(QWEN_7B, 8, (4, 4), keep_rate=0.5, keep_by="frame")
    one = estimate(get_mode("spava"), QWEN_7B, _work(QWEN_7B, 8, (4, 4), keep_rate=0.01),
                   cost.hardware("h200"))  # the first patch is always kept
    assert sum(r.temporal_patches for r in one.ranks) == 1
    unpruned = _work(QWEN_7B, 8, (4, 4))
    assert dataclasses.replace(unpruned, keep_rate=1.0) == unpruned and not unpruned.pruned


def test_plan_keep_rate_prints_the_pruned_prediction(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--preset", "qwen2.5-vl-7b", "--hardware", "h200", "--frames", "256",
            "--world-size", "8", "--modes", "spava,full"]
    assert main([*args, "--keep-rate", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "pruned to 0.3 of the video tokens: 38 of 128 temporal patches encoded, N=9744" \
        in out, out
    assert "pruned / unpruned: spava TTFT 0." in out, out
    assert main([*args, "--pruning-rate", "0.5"]) == 0
    assert "pruning_rate 0.5 after the tower: every patch encoded" in capsys.readouterr().out
    assert main([*args, "--keep-rate", "1.5"]) == 2
    assert "--keep-rate must be in (0, 1], got 1.5" in capsys.readouterr().err
    assert main([*args[:-6], "--keep-rate", "0.5"]) == 2
    assert "--keep-rate and --pruning-rate prune video: pass --frames" in \
        capsys.readouterr().err
