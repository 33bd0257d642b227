"""Deadline admission prices the decode work of a file's keyframe layout: gop.decode_work (what
check_request measures), admission.walked_frames (per rank, by mode) and the cost predictor."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from apbv import cost
from apbv.serve.scheduler import admission
from apbv.video import VideoMeta
from apbv.video.gop import decode_work, frame_split, rank_walks, walk, walked_frames
from apbv.video.sampling import Sampling

# 120 s at 30 fps, 8 frames sampled every 15 s (4 temporal patches), 1080p.
INDICES = tuple(range(0, 3600, 450))
SAMPLING = Sampling(INDICES, 2 / 15, 84, 140, 14)


def _meta(gop: int | None) -> VideoMeta:
    keys = None if gop is None else tuple(range(0, 3600, gop))
    return VideoMeta(3600, 30.0, 1080, 1920, keys)


def test_decode_work_counts_the_walks_of_the_engines_split() -> None:
    meta = _meta(240)  # a keyframe every 8 s: samples 0..7 s after one
    work = decode_work(meta, SAMPLING, 2)
    walks = rank_walks(meta.keyframes, INDICES, frame_split(SAMPLING, 2))
    one = walk(meta.keyframes, INDICES)
    assert work == {"source_pixels": 1920 * 1080, "walked": max(walks).frames,
                    "intervals": max(walks).intervals, "walked_one": one.frames,
                    "intervals_one": one.intervals}
    assert one.frames == walked_frames(meta.keyframes, INDICES) and one.intervals > 1
    assert work["walked"] < work["walked_one"] and work["walked"] > len(INDICES) // 2
    sparse = decode_work(_meta(3600), SAMPLING, 2)  # one keyframe: every rank walks from it
    assert sparse["walked"] > work["walked"]
    assert decode_work(_meta(None), SAMPLING, 2) == {"source_pixels": 1920 * 1080}
    assert "walked" not in decode_work(meta, SAMPLING, 8)  # fewer patches than ranks
    # InternVL3 splits whole frames: 8 ranks take one frame each, the farthest from its keyframe
    whole = Sampling(INDICES, 2 / 15, 84, 140, 14, temporal_patch_size=1)
    assert decode_work(meta, whole, 8)["walked"] == max(
        walked_frames(meta.keyframes, [i]) for i in INDICES) == 211


def test_walked_frames_per_rank_follow_the_mode() -> None:
    measured = {"walked": 300, "intervals": 5, "walked_one": 560, "intervals_one": 9}
    assert admission.walked_frames("spava", 2, measured) == ([300, 300], [5, 5])
    assert admission.walked_frames("no_vit_split", 2, measured) == ([560, 560], [9, 9])
    assert admission.walked_frames("full", 2, measured) == ([560], [9])
    assert admission.walked_frames("spava", 2, {"source_pixels": 10}) is None


def test_admission_predicts_more_for_a_file_that_walks_more(monkeypatch) -> None:
    """The same request (frames, tokens, sizes) on two keyframe layouts: the predicted TTFT
    differs by the cost model's price of the walk, and equals cost.predict given that walk
    and the decoded frame size."""
    dims = cost.preset_dims("qwen2.5-vl-3b")
    monkeypatch.setattr(cost, "checkpoint_dims", lambda path: dims)
    predictor = admission.cost_predictor("unused", 2, "cpu")
    tokens_per_patch = (84 // 28) * (140 // 28)
    base = {"frames": 8, "context_len": dims.video_start + 4 * tokens_per_patch + 2,
            "query_len": 9, "height": 84, "width": 140}
    call = SimpleNamespace(request=SimpleNamespace(mode=SimpleNamespace(name="spava"),
                                                   anchor_len=None, passing_len=None))
    dense = {**base, **decode_work(_meta(240), SAMPLING, 2)}
    sparse = {**base, **decode_work(_meta(3600), SAMPLING, 2)}
    unknown = {**base, "source_pixels": 1920 * 1080}
    got = {name: predictor(call, m) for name, m in
           (("dense", dense), ("sparse", sparse), ("unknown", unknown))}
    hw = cost.hardware("cpu")
    want = cost.predict("spava", dims, context_len=base["context_len"], query_len=9,
                        world_size=2, frames=8, grid=(3, 5), hw=hw,
                        source_pixels=1920 * 1080, walked_frames=[sparse["walked"]] * 2,
                        walked_intervals=[sparse["intervals"]] * 2).ttft_s
    assert got["sparse"] == pytest.approx(want)
    walk_s = ((sparse["walked"] - dense["walked"]) * hw.coded_frame_s_per_pixel
              + (sparse["intervals"] - dense["intervals"]) * hw.keyframe_s_per_pixel) * 1920 * 1080
    assert got["sparse"] - got["dense"] == pytest.approx(walk_s, rel=1e-6)
    assert got["unknown"] < got["dense"] < got["sparse"]


def test_footage_frame_s_prices_the_walk_and_each_resize() -> None:
    """Every coded frame walked (the sampled ones included) at coded_frame_s_per_pixel, each
    sampled frame's resize at convert_s_per_pixel; the earlier rule without the latter."""
    import dataclasses

    from apbv.cost.predict import footage_frame_s, walk_s

    hw = dataclasses.replace(cost.CPU, coded_frame_s_per_pixel=1e-9, convert_s_per_pixel=1e-8)
    assert footage_frame_s(hw, 100, 4, 1000) == pytest.approx((100 * 1e-9 + 4 * 1e-8) * 1000)
    assert footage_frame_s(hw, 3, 4, 1000) == pytest.approx((4 * 1e-9 + 4 * 1e-8) * 1000)
    keyed = dataclasses.replace(hw, keyframe_s_per_pixel=5e-9)  # each interval's seek and keyframe
    assert footage_frame_s(keyed, 100, 4, 1000, intervals=3) == pytest.approx(
        (100 * 1e-9 + 3 * 5e-9 + 4 * 1e-8) * 1000)
    earlier = dataclasses.replace(hw, convert_s_per_pixel=0.0)
    assert footage_frame_s(earlier, 100, 4, 1000) == pytest.approx(
        4 * (hw.decode_s_per_pixel * 1000 + hw.decode_frame_s) + walk_s(earlier, 100, 4, 1000))
