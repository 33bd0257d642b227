"""A served stream's frame size and KV reservation follow the served family
(apbv.serve.streams.budget.KVSizing, from the checkpoint's config): frame sides are multiples of
patch x merge (28 for Qwen2.5-VL and InternVL3, 32 for Qwen3-VL), a unit's tokens one per
merged patch of the family, and ``keep_vision`` reserves each kept token's tower row with its
DeepStack levels (Qwen3-VL: 4 x hidden)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from apbv import cost
from apbv.cost.qwen3_vl import released_qwen3_vl_8b
from apbv.serve.streams.budget import KVSizing
from apbv.video.sampling import stream_frame_size

NATIVE = [(1080, 1920), (480, 640), (48, 64), (720, 720)]
"""Native (H, W) frame sizes: wide, 4:3, below the token floor, square."""


def _sizing(preset: str, dtype_bytes: int = 2) -> KVSizing:
    return KVSizing.of_dims(cost.preset_dims(preset), 32768, dtype_bytes, world_size=2,
                            max_frames_per_push=4)


@pytest.mark.parametrize("preset", ["qwen2.5-vl-7b", "internvl3-2b"])
def test_qwen2_5_vl_and_internvl3_frame_sizes_stay_the_28_pixel_rule(preset: str) -> None:
    sizing = _sizing(preset)
    assert sizing.frame_multiple == 28
    for height, width in NATIVE:
        assert sizing.frame_size(height, width) == stream_frame_size(height, width)
    assert sizing.frame_size(1080, 1920) == (560, 1008)
    assert sizing.frame_size(48, 64, max_pixels=56 * 56) == (56, 56)


def test_qwen3_vl_frame_sizes_are_multiples_of_32_by_the_one_shot_rule() -> None:
    sizing = _sizing("qwen3-vl-8b")
    assert sizing.frame_multiple == 32
    # the one-shot path's resize for 16-pixel patches (qwen-vl-utils' 128..768 token bounds
    # of 32 x 32 pixels), not Qwen2.5-VL's (476, 644) for 480x640
    assert [sizing.frame_size(h, w) for h, w in NATIVE] == [
        (640, 1152), (480, 640), (320, 448), (704, 704)]
    for h, w in NATIVE:
        assert sizing.frame_size(h, w) == stream_frame_size(h, w, image_patch_size=16)
    assert sizing.frame_size(48, 64, max_pixels=64 * 64) == (64, 64)
    with pytest.raises(ValueError, match="max_pixels"):
        sizing.frame_size(48, 64, min_pixels=5000, max_pixels=4000)


def test_a_unit_reserves_one_token_per_merged_patch_of_the_family() -> None:
    pixels = 480 * 640
    assert _sizing("qwen2.5-vl-7b").unit_tokens(pixels) == pixels // (28 * 28) == 391
    assert _sizing("qwen3-vl-8b").unit_tokens(pixels) == pixels // (32 * 32) == 300
    internvl = _sizing("internvl3-2b")  # one fixed 448x448 tile a frame, whatever the size
    assert internvl.unit_tokens(pixels) == internvl.unit_tokens(56 * 56) == \
        internvl.tile_tokens == 256 + cost.internvl.INTERNVL_UNIT_TEXT


def test_keep_vision_reserves_the_kept_tower_rows_with_their_deepstack_levels() -> None:
    qwen3 = _sizing("qwen3-vl-8b")
    dims = cost.preset_dims("qwen3-vl-8b")
    kv = 2 * 36 * 8 * 128 * 2  # K and V of 36 layers, 8 KV heads of 128, 2-byte values
    assert qwen3.kv_bytes_per_token == kv
    assert qwen3.vision_bytes_per_token == 4096 * (1 + 3) * 2  # hidden x (1 + 3 levels)
    tokens = qwen3.tokens_per_rank(300, 2.0, 4.0, None)
    assert qwen3.need(300, 2.0, 4.0, None) == kv * tokens
    assert qwen3.need(300, 2.0, 4.0, None, keep_vision=True) == \
        (kv + dims.hidden * 4 * 2) * tokens
    qwen25 = _sizing("qwen2.5-vl-7b", dtype_bytes=4)  # no extra levels: hidden wide
    assert qwen25.vision_bytes_per_token == 3584 * 4


def test_of_checkpoint_reads_the_family_from_config_json(tmp_path: Path) -> None:
    config = released_qwen3_vl_8b()
    config["max_position_embeddings"] = 262144
    (tmp_path / "config.json").write_text(json.dumps(config))
    sizing = KVSizing.of_checkpoint(str(tmp_path), 2, world_size=2, max_frames_per_push=4)
    assert sizing == dataclasses.replace(_sizing("qwen3-vl-8b"), max_positions=262144)
    assert (sizing.patch_size, sizing.frame_multiple, sizing.frames_per_unit) == (16, 32, 2)


def test_a_merge_the_resize_rule_cannot_follow_is_refused() -> None:
    dims = dataclasses.replace(cost.preset_dims("qwen3-vl-8b"), spatial_merge_size=3)
    with pytest.raises(ValueError, match="spatial_merge_size of 2"):
        KVSizing.of_dims(dims, 32768, 2, world_size=1, max_frames_per_push=1)
