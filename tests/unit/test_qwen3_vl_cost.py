"""Qwen3-VL in the cost model: the ``qwen3-vl-8b`` preset's released size, DeepStack's additions
(three more mergers' work, four rows of hidden values per video token held and moved), the
prompt geometry against the engine's prompt (the tiny checkpoint's processor), and
``plan --preset qwen3-vl-8b``."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from apbv import cost
from apbv.__main__ import main
from apbv.cost.hardware import Machine
from apbv.cost.qwen3_vl import QWEN3_VL_VIDEO_START, qwen3_vl_video_start
from apbv.cost.schedule import vision_cost
from apbv.video import Sampling


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


@pytest.fixture(scope="module")
def processor(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from apbv.model.tiny_qwen3_vl import tiny_processor

    return tiny_processor(tmp_path_factory.mktemp("qwen3-processor"))


def test_prompt_geometry_is_the_engines(processor: Any) -> None:
    """video_start and the context length of a prompt with timestamps 0.0, 10.0 and 20.0 s
    (the 2-digit ones of a typical clip between patches), as the engine builds the prompt."""
    from apbv.model.qwen3_vl_prompt import Qwen3VLRules

    assert qwen3_vl_video_start(processor) == QWEN3_VL_VIDEO_START
    dims = cost.preset_dims("qwen3-vl-8b")
    rules = Qwen3VLRules(processor)
    sampling = Sampling((0, 1, 300, 301, 600, 601), 0.2, 128, 160, 16, video_fps=30.0,
                        processor_resize=True)
    context, _ = rules.prompt("What happens?", rules.video_grid(sampling), sampling=sampling)
    assert cost.video_context_len(dims, 3, (4, 5)) == len(context)
    video = context.tolist().index(processor.video_token_id)
    assert video == dims.video_start


def test_plan_predicts_qwen3_vl(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "qwen3-vl-8b", "--world-size", "8", "--frames",
                 "64"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-vl-8b; 64 frames" in out and "spava" in out and "full" in out, out
