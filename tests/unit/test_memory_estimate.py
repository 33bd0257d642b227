"""apbv.cost.request_memory: the preflight memory estimate of one rank for one request."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from apbv import cost
from apbv.engine.kvcache import RankKVCache
from apbv.modes import get_mode
from apbv.ownership import owned_local_index
from apbv.plan import QUERY_RANK, make_plan, patch_ranges

QWEN_7B = cost.preset_dims("qwen2.5-vl-7b")
GRID = (36, 64)  # 1008 x 1792 pixels: 18 x 32 = 576 tokens per temporal patch


def _video_plan(patches: int, world_size: int, tokens_per_patch: int = 576):
    context = QWEN_7B.video_start + patches * tokens_per_patch + 1
    return make_plan(context, 64, world_size)


def _estimate(patches: int, world_size: int, rank: int = 0, reserve: int = 128,
              dtype_bytes: int = 2) -> cost.MemoryEstimate:
    plan = _video_plan(patches, world_size)
    share = patch_ranges(patches, world_size)[rank]
    return cost.request_memory(QWEN_7B, plan, patches=share[1] - share[0], grid_hw=GRID,
                               dtype_bytes=dtype_bytes, reserve_tokens=reserve, rank=rank)


def test_more_frames_need_more_memory() -> None:
    totals = [_estimate(p, 4).total for p in (16, 64, 128)]
    assert totals[0] < totals[1] < totals[2]
    small, large = _estimate(16, 4), _estimate(128, 4)
    for part in ("frames", "pixel_values", "vision_activations", "kv_cache",
                 "decoder_activations", "video_embeddings"):
        assert small.parts[part] < large.parts[part], part
    assert small.parts["weights"] == large.parts["weights"] == QWEN_7B.parameters() * 2


def test_more_ranks_need_less_memory_per_rank() -> None:
    by_world = [_estimate(128, h) for h in (1, 2, 4, 8)]
    for fewer, more in itertools.pairwise(by_world):
        assert more.total < fewer.total
        assert more.parts["kv_cache"] < fewer.parts["kv_cache"]
        assert more.parts["frames"] < fewer.parts["frames"]
    # Only the weights stay: 8 ranks need far less than 8 times less, and more than weights.
    assert by_world[-1].total > by_world[-1].parts["weights"]


@pytest.mark.parametrize("mode", ["spava", "zigzag_ring", "star", "apb"])
def test_kv_term_is_what_the_rank_kv_cache_allocates(mode: str) -> None:
    dims = dataclasses.replace(QWEN_7B, layers=3, kv_heads=2, head_dim=8)
    plan = get_mode(mode).plan(997, 13, 3)
    for rank in range(plan.world_size):
        reserve = 5 if rank == QUERY_RANK else 0
        cache = RankKVCache(dims.layers, reserve=reserve)
        owned = len(owned_local_index(plan, rank))
        for layer in range(dims.layers):
            kv = torch.zeros(1, owned, dims.kv_heads, dims.head_dim, dtype=torch.bfloat16)
            cache.store(layer, kv, kv)
        allocated = sum(t.untyped_storage().nbytes()
                        for t in cache._k + cache._v)  # the reservation included
        est = cost.request_memory(dims, plan, patches=0, grid_hw=(0, 0), dtype_bytes=2,
                                  reserve_tokens=5, rank=rank)
        assert est.parts["kv_cache"] == allocated
        assert cache.nbytes() == allocated - 2 * dims.layers * reserve * 2 * 8 * 2


def test_decode_reserve_only_on_the_query_rank() -> None:
    for rank in range(4):
        none, some = _estimate(64, 4, rank, reserve=0), _estimate(64, 4, rank, reserve=100)
        grown = some.parts["kv_cache"] - none.parts["kv_cache"]
        if rank == QUERY_RANK:
            assert grown == QWEN_7B.layers * 100 * 2 * QWEN_7B.kv_heads * QWEN_7B.head_dim * 2
        else:
            assert grown == 0
        assert {k: v for k, v in some.parts.items() if k != "kv_cache"} == \
            {k: v for k, v in none.parts.items() if k != "kv_cache"}


def test_weights_are_the_checkpoints_parameters() -> None:
    from apbv.model.qwen2_5_vl.tiny import build_tiny_model, tiny_config

    model = build_tiny_model()
    dims = cost.model_dims(tiny_config().to_dict())
    assert dims.parameters() == sum(p.numel() for p in model.parameters())
    tied = dataclasses.replace(QWEN_7B, tied_embeddings=True)
    assert QWEN_7B.parameters() - tied.parameters() == QWEN_7B.vocab * QWEN_7B.hidden
    assert cost.preset_dims("qwen2.5-vl-3b").tied_embeddings  # as released


def test_total_is_the_largest_phase_and_describe_names_it() -> None:
    est = _estimate(128, 2)
    phases = {name: sum(est.parts[p] for p in parts) for name, parts in est.phases.items()}
    assert est.total == max(phases.values()) == phases[est.peak_phase]
    assert est.device_total <= est.total
    line = est.describe()
    assert line.startswith(f"rank 0: {est.total / 1024**3:.3f} GiB at its {est.peak_phase} peak")
    largest = max(est.phases[est.peak_phase], key=lambda p: est.parts[p])
    assert largest in line and "\n" not in line
    # Without video only the decoder's parts are left.
    plain = cost.request_memory(QWEN_7B, make_plan(50000, 64, 2), patches=0, grid_hw=(0, 0),
                                dtype_bytes=2, reserve_tokens=0, rank=1)
    assert plain.parts["frames"] == plain.parts["pixel_values"] == 0
    assert plain.peak_phase == "prefill"


def test_bad_arguments_name_the_problem() -> None:
    plan = make_plan(1000, 10, 2)
    args = {"patches": 2, "grid_hw": (4, 4), "dtype_bytes": 2, "reserve_tokens": 0, "rank": 0}
    cost.request_memory(QWEN_7B, plan, **args)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        cost.request_memory(QWEN_7B, plan, **{**args, "rank": 2})
    with pytest.raises(ValueError, match="dtype_bytes must be one of 1, 2, 4, 8, got 3"):
        cost.request_memory(QWEN_7B, plan, **{**args, "dtype_bytes": 3})
    with pytest.raises(ValueError, match="grid_hw must be two positive multiples of the "
                                         "spatial merge size 2, got \\(5, 4\\)"):
        cost.request_memory(QWEN_7B, plan, **{**args, "grid_hw": (5, 4)})
    with pytest.raises(ValueError, match="patches must be an integer >= 0, got -1"):
        cost.request_memory(QWEN_7B, plan, **{**args, "patches": -1})


def test_patch_rows_processor_and_tower_calls_change_what_is_held() -> None:
    """Pixel levels hold a quarter of the float rows' bytes; the HF processor adds its float32
    copies of the frames; a tower call over fewer rows holds fewer activations (plus the
    calls' embeddings and their concatenation)."""
    plan = _video_plan(16, 1)
    args = dict(patches=16, grid_hw=GRID, dtype_bytes=2, reserve_tokens=0, rank=0)
    levels = cost.request_memory(QWEN_7B, plan, **args)
    floats = cost.request_memory(QWEN_7B, plan, **args, row_bytes=4)
    processor = cost.request_memory(QWEN_7B, plan, **args, row_bytes=4,
                                    processor_copies=cost.PROCESSOR_FLOAT_COPIES)
    rows = 16 * GRID[0] * GRID[1]
    assert levels.parts["pixel_values"] == rows * 1176
    assert floats.parts["pixel_values"] == 4 * levels.parts["pixel_values"]
    frames = levels.parts["frames"]
    assert frames == rows * 2 * 14 * 14 * 3
    assert processor.parts["processor"] - floats.parts["processor"] == int(2.5 * frames * 4)
    assert levels.parts["decode"] == 6 * min(frames, 1 << 25)
    one_patch = cost.request_memory(QWEN_7B, plan, **args, call_rows=GRID[0] * GRID[1])
    per_row = 2 * (10 * QWEN_7B.vision_hidden + 3 * QWEN_7B.vision_intermediate + 1176)
    embeddings = rows // 4 * QWEN_7B.hidden * 2
    assert levels.parts["vision_activations"] == rows * per_row + embeddings
    assert one_patch.parts["vision_activations"] == rows // 16 * per_row + 2 * embeddings
    with pytest.raises(ValueError, match="row_bytes must be one of 1, 2, 4, 8, got 3"):
        cost.request_memory(QWEN_7B, plan, **args, row_bytes=3)


def test_the_engine_estimates_with_its_own_rows_and_tower_calls(tiny_config) -> None:
    from apbv.distributed import DistInfo
    from apbv.engine.engine import Engine

    engine = Engine(tiny_config, DistInfo(0, 1, 0, torch.device("cpu"), None))
    request = engine.request("v.mp4", "What is shown?", max_new_tokens=1)

    def estimate() -> cost.MemoryEstimate:
        return engine.memory_estimate(request, 500, 20, (0, 16), (28, 28), 1)

    rows = 16 * 28 * 28  # calls of 10 temporal patches (8192 rows at most)
    assert engine.model.preprocess == "levels" and engine.model.chunk_rows == 8192
    assert estimate().parts["pixel_values"] == rows * 1176  # int8 levels
    assert estimate().parts["processor"] == rows * 1176
    calls = estimate().parts["vision_activations"]
    engine.model.chunk_rows = 0
    assert estimate().parts["vision_activations"] > calls  # the whole share in one call
    engine.model.preprocess = "processor"
    est = estimate()
    assert est.parts["pixel_values"] == rows * 1176 * 4
    assert est.parts["processor"] == int(2.5 * est.parts["frames"] * 4) + rows * 1176 * 4
