"""InternVL3's memory preflight counts the decoded frames as the rank holds them: at the file's
native size (the stock processor resizes them to 448x448 only when it makes the rows), not at
the 448x448 tile; Qwen2.5-VL's frames arrive resized, so its count is the grid's size as
before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from apbv import cost
from apbv.config import load_config
from apbv.distributed import DistInfo
from apbv.engine.engine import Engine
from apbv.modes import get_mode
from tests.families import tiny_dir

NATIVE_HW = (120, 160)
FRAMES = 3


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = tiny_dir(tmp_path_factory, "internvl")
    cfg = load_config("tiny_cpu", [f"model.path={str(path)!r}", f"video.nframes={FRAMES}"])
    return Engine(cfg, DistInfo(0, 1, 0, torch.device("cpu"), None))


def test_preflight_counts_the_frames_at_their_decoded_size(engine: Engine, tmp_path: Path,
                                                           monkeypatch) -> None:
    from apbv.synthetic.videos import write_test_video

    video = write_test_video(tmp_path / "v.mp4", num_frames=6, fps=2.0,
                             width=NATIVE_HW[1], height=NATIVE_HW[0], seed=4)
    seen: list[cost.MemoryEstimate] = []
    estimate = engine.memory_estimate

    def recorded(*args, **kwargs) -> cost.MemoryEstimate:
        seen.append(estimate(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(engine, "memory_estimate", recorded)
    inputs = engine.preprocess(engine.request(str(video), "What is shown?", mode="exact"))
    assert inputs.num_frames == FRAMES and len(seen) == 1
    # uint8 RGB frames at 160x120 as decoded; the 448x448 tile would be 3 * 448 * 448 each
    assert seen[0].parts["frames"] == FRAMES * 3 * NATIVE_HW[0] * NATIVE_HW[1]
    assert seen[0].parts["pixel_values"] == FRAMES * 3 * 448 * 448 * 4  # float rows


def test_frame_size_defaults_to_the_grid_and_is_checked() -> None:
    dims = cost.preset_dims("internvl3-2b")
    plan = get_mode("exact").plan(2000, 20, 1)
    args = dict(patches=4, grid_hw=(32, 32), dtype_bytes=2, reserve_tokens=0, rank=0)
    tile = cost.request_memory(dims, plan, **args)
    held = cost.request_memory(dims, plan, **args, frame_hw=(1080, 1920))
    assert tile.parts["frames"] == 4 * 3 * 448 * 448
    assert held.parts["frames"] == 4 * 3 * 1080 * 1920
    assert held.parts["pixel_values"] == tile.parts["pixel_values"]
    with pytest.raises(ValueError, match=r"frame_hw must be two positive integers \(pixels\)"):
        cost.request_memory(dims, plan, **args, frame_hw=(0, 1920))
