"""The default vision cache sizes the largest admitted frame in the served family's merged
patches: 28 pixels a side for Qwen2.5-VL (14-pixel patches, merge 2), 32 for Qwen3-VL (16)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from apbv import cost
from apbv.config import RuntimeConfig
from apbv.openai.policy import Limits
from apbv.serve.vision_budget import largest_request_bytes


# --max-pixels-per-frame's default, 768 x 28 x 28 pixels: 768 merged cells of 28x28 (27 x 28
# cells, the patch grid twice that), or 588 of 32x32 (24 x 24); the old rule counted 28x28
# cells for every family
@pytest.mark.parametrize(("patch", "grid_hw"), [(14, (54, 56)), (16, (48, 48))])
def test_the_largest_frame_is_counted_in_the_familys_patches(
        monkeypatch: pytest.MonkeyPatch, patch: int, grid_hw: tuple[int, int]) -> None:
    dims = dataclasses.replace(cost.preset_dims("qwen2.5-vl-3b"), patch_size=patch)
    grids = []

    def memory(dims, plan, *, grid_hw, **kw):
        grids.append(grid_hw)
        return SimpleNamespace(total=1)

    monkeypatch.setattr(cost, "checkpoint_dims", lambda path: dims)
    monkeypatch.setattr(cost, "request_memory", memory)
    largest_request_bytes(RuntimeConfig(), Limits(), world_size=2, use_gpu=False)
    assert grids and set(grids) == {grid_hw}, (patch, grids)
