"""InternVL3's frame choice (apbv.model.internvl.adapter.internvl_sampling) against the stock video
processor's ``sample_frames`` rule, and its refusals."""

from __future__ import annotations

import pytest
import torch

from apbv.model.internvl.prompt import internvl_sampling
from apbv.video import VideoMeta, VideoSpec

SIZE = (448, 448)


def _stock(total: int, n: int) -> list[int]:
    """transformers 5.24's InternVLVideoProcessor.sample_frames with its initial shift."""
    from transformers import InternVLVideoProcessor
    from transformers.video_utils import VideoMetadata

    processor = InternVLVideoProcessor()
    meta = VideoMetadata(total_num_frames=total, fps=30.0)
    return processor.sample_frames(meta, num_frames=n).tolist()


def test_the_documented_example() -> None:
    got = internvl_sampling(VideoSpec("v.mp4", nframes=8), VideoMeta(300, 30.0, 720, 1280), SIZE)
    assert got.indices == (18, 56, 93, 131, 168, 206, 243, 281)
    assert got.temporal_patch_size == 1 and got.num_patches == 8
    assert (got.resized_height, got.resized_width) == (720, 1280)  # the processor resizes


@pytest.mark.parametrize("total,n", [(300, 8), (30, 5), (97, 7), (1000, 64), (64, 64), (7, 3)])
def test_matches_the_stock_rule(total: int, n: int) -> None:
    got = internvl_sampling(VideoSpec("v.mp4", nframes=n), VideoMeta(total, 30.0, 10, 10), SIZE)
    assert list(got.indices) == _stock(total, n)
    assert got.num_frames == n


def test_fps_sets_the_count_as_the_processor_does() -> None:
    meta = VideoMeta(95, 25.0, 10, 10)  # 3.8 s: int(95 / 25 * 2) = 7 frames
    got = internvl_sampling(VideoSpec("v.mp4", fps=2.0), meta, SIZE)
    assert got.num_frames == 7 and list(got.indices) == _stock(95, 7)
    capped = internvl_sampling(VideoSpec("v.mp4", fps=2.0, max_frames=4), meta, SIZE)
    assert capped.num_frames == 4


@pytest.mark.parametrize("spec,needle", [
    (VideoSpec("v.mp4", nframes=40), "nframes=40 gives 40 frames"),
    (VideoSpec("v.mp4", fps=0.01), "1 .. 30"),
    (VideoSpec("v.mp4", nframes=4, video_start=1.0), "video_start are not used"),
    (VideoSpec("v.mp4", nframes=4, resized_height=28, resized_width=28), "resized_height"),
])
def test_refusals_name_the_setting(spec: VideoSpec, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        internvl_sampling(spec, VideoMeta(30, 10.0, 10, 10), SIZE)


def test_float32_truncation() -> None:
    """The stock rule computes in float32: 7 of 122 frames differ from a float64 arange."""
    total, n = 122, 7
    wide = torch.arange(total / n / 2, total, total / n, dtype=torch.float64).int().tolist()
    got = internvl_sampling(VideoSpec("v.mp4", nframes=n), VideoMeta(total, 30.0, 10, 10), SIZE)
    assert list(got.indices) == _stock(total, n) != wide
