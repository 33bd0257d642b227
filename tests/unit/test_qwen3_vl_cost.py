"""Qwen3-VL in the cost model: the ``qwen3-vl-8b`` preset's released size, DeepStack's additions
(three more mergers' work, four rows of hidden values per video token held and moved) and
``plan --preset qwen3-vl-8b``. The prompt geometry against the engine's prompt is checked in
tests/unit/test_qwen3_vl_rules.py, which has the tiny processor."""

from __future__ import annotations

import dataclasses

import pytest

from apbv import cost
from apbv.__main__ import main
from apbv.cost.hardware import Machine
from apbv.cost.schedule import vision_cost


def test_preset_has_the_released_size() -> None:
    """Qwen3-VL-8B-Instruct's model card: 8.77B parameters; 36 layers of 32 query and 8 KV heads
    of 128; 3 DeepStack levels."""
    dims = cost.preset_dims("qwen3-vl-8b")
    assert abs(dims.parameters() / 1e9 - 8.77) / 8.77 < 0.01, dims.parameters()
    assert (dims.layers, dims.heads, dims.kv_heads, dims.head_dim) == (36, 32, 8, 128)
    assert (dims.patch_size, dims.vision_gated, dims.deepstack_levels) == (16, False, 3)
    assert dims.fullatt_blocks == dims.vision_depth == 27
    assert dims.embedding_width == 4 * 4096


def test_deepstack_adds_three_mergers() -> None:
    """The vision FLOPs of one temporal patch of 14x14 tokens: without DeepStack, less by
    exactly three mergers (LayerNorm-free matmuls: 4608 -> 4608 -> 4096 per token)."""
    dims = cost.preset_dims("qwen3-vl-8b")
    plain = dataclasses.replace(dims, deepstack_levels=0)
    machine = Machine(cost.h200(), 2)
    _, with_levels = vision_cost(dims, 1, (14, 14), machine)
    _, without = vision_cost(plain, 1, (14, 14), machine)
    wide = 1152 * 4
    assert with_levels - without == 3 * 2 * 196 * (wide * wide + wide * 4096)


def test_plan_predicts_qwen3_vl(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "qwen3-vl-8b", "--world-size", "8", "--frames",
                 "64"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-vl-8b; 64 frames" in out and "spava" in out and "full" in out, out
