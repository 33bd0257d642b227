"""The cost model's decode work from a file's keyframe structure: predict's walked_frames and
plan --video's predicted seconds per rank (the coded frames walked past the sampled ones at
coded_frame_s_per_pixel each, the sampled ones at decode_s_per_pixel)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from apbv import cost
from apbv.cost.predict import footage_frame_s, predict, walk_s
from apbv.video import VideoSpec, plan_sampling, probe
from apbv.video.gop import rank_walks

HW = dataclasses.replace(cost.CPU, coded_frame_s_per_pixel=1e-9, convert_s_per_pixel=0.0)
SMALL = cost.preset_dims("qwen2.5-vl-3b")


def test_walked_frames_add_the_walk_to_each_ranks_preprocess() -> None:
    tokens_per_patch, frames, pixels = 16, 8, 1920 * 1080
    kwargs = dict(context_len=SMALL.video_start + 4 * tokens_per_patch + 1, query_len=8,
                  world_size=2, frames=frames, tokens_per_patch=tokens_per_patch, hw=HW,
                  source_pixels=pixels)
    plain = predict("spava", SMALL, **kwargs)
    walked = predict("spava", SMALL, walked_frames=[4 + 100, 4 + 30], **kwargs)
    assert walk_s(HW, 104, 4, pixels) == pytest.approx(100 * 1e-9 * pixels)
    ranks = [r.seconds["preprocess"] for r in walked.ranks]
    assert ranks == pytest.approx([r.seconds["preprocess"] + walk_s(HW, w, 4, pixels)
                                   for r, w in zip(plain.ranks, (104, 34))])
    assert walked.seconds["preprocess"] > plain.seconds["preprocess"]
    assert walk_s(HW, 3, 4, pixels) == 0.0  # nothing walked past the sampled frames
    with pytest.raises(ValueError, match=r"walked_frames must give one count per rank \(2\)"):
        predict("spava", SMALL, walked_frames=[1], **kwargs)


def test_plan_video_predicts_from_the_walk(tmp_path, capsys) -> None:
    from apbv.__main__ import main
    from apbv.video.footage import write_camera_video

    path = write_camera_video(tmp_path / "cam.mp4", seconds=4, fps=30, width=640, height=360,
                              gop_seconds=2.0, bframes=2)
    assert main(["plan", "--video", str(path), "--world-size", "2", "--hardware", "cpu"]) == 0
    out = capsys.readouterr().out
    spec = VideoSpec(str(path), fps=2.0, backend="pyav")
    sampling = plan_sampling(spec, probe(spec))
    keys = probe(spec).keyframes
    walks = rank_walks(keys, sampling.indices, [(0, 2), (2, 4)])
    hw, pixels = cost.CPU, 640 * 360
    resized = sampling.resized_width * sampling.resized_height
    for rank, walk in enumerate(walks):
        want = (hw.preprocess_fixed_s + hw.video_open_s
                + footage_frame_s(hw, walk.frames, 4, pixels, walk.intervals)
                + 4 * hw.process_s_per_pixel * resized)
        got = re.search(rf"rank {rank}: 4 sampled frames, {walk.frames} coded frames walked "
                        rf"in {walk.intervals} keyframe intervals, "
                        r"predicted frame work ([\d.]+) s", out)
        assert got and float(got[1]) == pytest.approx(want, abs=0.006), (out, want)
        # the earlier rule priced every walked frame as a sampled one: 10x more here
        assert walk.frames * hw.decode_s_per_pixel * pixels > 10 * walk_s(hw, walk.frames, 4,
                                                                          pixels)
