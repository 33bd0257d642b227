"""A live stream's KV reservation follows the model family (apbv.serve.streams.budget):
InternVL3 adds one fixed tile's rows per frame (256 video tokens and the ``FrameN: <img>``
text, whatever the frame size), Qwen2.5-VL one token per 28x28 pixels per two frames."""

from __future__ import annotations

import json
from pathlib import Path

from apbv.cost.internvl import INTERNVL_UNIT_TEXT, released_internvl3
from apbv.serve.streams.budget import KVSizing


def test_internvl_streams_reserve_a_tile_per_frame(tmp_path: Path) -> None:
    from apbv.model.internvl.tiny import _processor

    (tmp_path / "work").mkdir()
    _processor(tmp_path / "work").save_pretrained(tmp_path)  # the chat template it reads
    config = released_internvl3(28, 1536, 12, 2, 8960, False)
    config["text_config"]["max_position_embeddings"] = 32768
    (tmp_path / "config.json").write_text(json.dumps(config))
    sizing = KVSizing.of_checkpoint(str(tmp_path), 2, world_size=2, max_frames_per_push=3)
    rows = 256 + INTERNVL_UNIT_TEXT
    assert (sizing.frames_per_unit, sizing.tile_tokens) == (1, rows)
    assert sizing.unit_tokens(56 * 56) == sizing.unit_tokens(1920 * 1080) == rows
    # 4 s at 2 fps: 8 frames (+1) over 2 ranks, and a push of 3 frames
    assert sizing.tokens_per_rank(rows, 2.0, 4.0, None) == -(-9 * rows // 2) + 3 * rows


def test_qwen_streams_reserve_by_frame_size() -> None:
    sizing = KVSizing(kv_bytes_per_token=512, max_positions=4096, world_size=2,
                      max_frames_per_push=3)
    assert sizing.unit_tokens(56 * 56) == 4
    # 4 s at 2 fps: 4 patches (+1) of 4 tokens over 2 ranks, and a push of 2 patches
    assert sizing.tokens_per_rank(4, 2.0, 4.0, None) == 10 + 8
