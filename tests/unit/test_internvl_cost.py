"""InternVL3 in the cost model: the presets' released shapes, InternViT's vision work
(whole-frame attention, GELU MLP, the pixel shuffle projector) and ``plan --preset
internvl3-2b``. The prompt geometry against the engine's prompt is checked in
tests/multirank/test_internvl_multirank.py, which has the tiny checkpoint."""

from __future__ import annotations

import pytest

from apbv import cost
from apbv.__main__ import main
from apbv.cost.hardware import Machine
from apbv.cost.internvl import INTERNVL_VIDEO_START
from apbv.cost.schedule import vision_cost


@pytest.mark.parametrize("name,billions", [("internvl3-2b", 2.09), ("internvl3-8b", 7.94)])
def test_presets_have_the_released_sizes(name: str, billions: float) -> None:
    """The model cards' parameter counts (InternVL3-2B: 2.09B, InternVL3-8B: 7.94B)."""
    dims = cost.preset_dims(name)
    assert abs(dims.parameters() / 1e9 - billions) / billions < 0.01, dims.parameters()
    assert (dims.temporal_patch_size, dims.frame_side, dims.vision_gated) == (1, 448, False)


def test_vision_work_is_internvits() -> None:
    """FLOPs of one 448x448 frame counted by hand: patch embedding, 24 blocks of full
    attention over its 1024 patches with a two-matmul MLP, the 4096 -> 1536 -> 1536 projector
    over 256 tokens (a Qwen-style windowed, gated tower would count otherwise)."""
    dims = cost.preset_dims("internvl3-2b")
    _, flops = vision_cost(dims, 1, (16, 16), Machine(cost.h200(), 2))
    n, h, i = 1024, 1024, 4096
    block = 2 * n * (h * 3 * h + h * h + h * i + i * h) + 4 * 64 * 16 * n * n
    expected = 2 * n * 3 * 14 * 14 * h + 24 * block + 2 * 256 * (4 * h * 1536 + 1536 * 1536)
    assert flops == expected


def test_plan_predicts_internvl3(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "internvl3-2b", "--world-size", "8", "--frames",
                 "64"]) == 0
    out = capsys.readouterr().out
    n = INTERNVL_VIDEO_START + 64 * 256 + 63 * 7 + 2
    assert "448x448 tiles (256 tokens each)" in out and f"N={n} " in out, out
    assert "64 frames, 16x16 tokens per 1 frame" in out
    assert "spava" in out and "full" in out


def test_the_tile_side_is_held_once() -> None:
    """The tile's side is the vision config's image size, held once (``window_size``: the
    tile is the one attention window); ``frame_side`` reads it."""
    import dataclasses

    dims = cost.preset_dims("internvl3-2b")
    assert "frame_side" not in {f.name for f in dataclasses.fields(dims)}
    assert dims.frame_side == dims.window_size == 448 and dims.tiled_frames
    assert dataclasses.replace(dims, window_size=224).frame_side == 224
    assert cost.preset_dims("qwen2.5-vl-7b").frame_side is None
