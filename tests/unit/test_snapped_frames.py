"""The sampled frames that video.snap_to_keyframes moved, in the result's JSON (generate --json)
and in the server's ``apbv`` block; absent from the block with exact sampling."""

from __future__ import annotations

from apbv.engine.request import Result
from apbv.openai.responses import apbv_block


def _result(**extra: object) -> Result:
    return Result(answer="a", token_ids=[1], ttft_s=1.0, seconds={}, mode="spava",
                  world_size=2, frames=4, context_len=10, query_len=3, anchor_len=1,
                  passing_len=1, embedding_bytes=0, allgather_bytes=0, kv_cache_bytes_max=0,
                  **extra)  # type: ignore[arg-type]


def test_snapped_frames_reach_the_json_and_the_apbv_block() -> None:
    moved = [{"position": 1, "frame": 14, "keyframe": 0}]
    result = _result(snapped_frames=moved)
    assert result.to_json()["snapped_frames"] == moved
    assert apbv_block(result, 0.0)["snapped_frames"] == moved
    assert apbv_block(_result(snapped_frames=[]), 0.0)["snapped_frames"] == []
    exact = _result()
    assert exact.to_json()["snapped_frames"] is None
    assert "snapped_frames" not in apbv_block(exact, 0.0)
