"""``apbv plan --video FILE --model CHECKPOINT``: the decode work of the frames the checkpoint's
family samples (InternVL3: its own frame choice, one frame per temporal patch), not
qwen-vl-utils' frames in pairs."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("av")


def test_plan_video_samples_as_the_checkpoints_family(tmp_path, capsys) -> None:
    from transformers import AutoProcessor

    from apbv.__main__ import main
    from apbv.model.internvl.prompt import InternVLRules
    from apbv.model.internvl.tiny import write_tiny_internvl
    from apbv.plan import patch_ranges
    from apbv.video import VideoSpec, plan_sampling, probe
    from apbv.video.footage import write_camera_video
    from apbv.video.gop import rank_walks

    video = write_camera_video(tmp_path / "cam.mp4", seconds=3.5, fps=30, width=320,
                               height=180, gop_seconds=1.0, bframes=2)
    model = write_tiny_internvl(tmp_path / "internvl")
    spec = VideoSpec(str(video), fps=2.0, backend="pyav")
    meta = probe(spec)
    keys = meta.keyframes
    rules = InternVLRules(AutoProcessor.from_pretrained(model, local_files_only=True))
    sampling = rules.plan_sampling(spec, meta)
    qwen = plan_sampling(spec, meta)
    assert sampling.temporal_patch_size == 1 and sampling.num_frames % 2 == 1, sampling
    assert sampling.indices != qwen.indices  # the two rules choose different frames here

    assert main(["plan", "--video", str(video), "--model", str(model), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert f"{sampling.num_frames} frames sampled" in out
    assert "InternVLProcessor's rules (1 per temporal patch)" in out
    ranges = patch_ranges(sampling.num_frames, 2)
    for rank, ((start, end), walk) in enumerate(zip(ranges, rank_walks(keys, sampling.indices,
                                                                         ranges, unit=1))):
        line = (f"rank {rank}: {end - start} sampled frames, {walk.frames} coded frames walked "
                f"in {walk.intervals} keyframe intervals")
        assert line in out, (line, out)

    assert main(["plan", "--video", str(video), "--world-size", "2"]) == 0  # no --model
    out = capsys.readouterr().out
    assert f"{qwen.num_frames} frames sampled" in out
    assert "qwen-vl-utils' (Qwen2.5-VL) rules (2 per temporal patch)" in out
    assert re.search(rf"rank 0: {2 * patch_ranges(qwen.num_patches, 2)[0][1]} sampled", out)


def test_keyframe_aligned_ranges_of_single_frames() -> None:
    """unit=1 (InternVL3): an odd frame count splits, and a boundary moves by one frame to a
    keyframe interval's edge."""
    from apbv.video.gop import keyframe_aligned_ranges, rank_walks, shared_intervals

    keys = [0, 30, 60, 90]
    indices = [5, 20, 35, 50, 65, 80, 95]  # two samples per interval, one in the last
    balanced = [(0, 4), (4, 7)]  # frames 5..50 and 65..95: the split is at 50 | 65, clean
    assert keyframe_aligned_ranges(keys, indices, 2, unit=1) == balanced
    three = keyframe_aligned_ranges(keys, indices, 3, unit=1)  # balanced: 3, 2, 2 frames
    assert three == [(0, 2), (2, 4), (4, 7)] and shared_intervals(keys, indices, three, 1) == 0
    assert [w.frames for w in rank_walks(keys, indices, three, 1)] == [21, 21, 21 + 6]


def test_plan_video_with_a_missing_checkpoint_says_so(tmp_path, capsys) -> None:
    from apbv.__main__ import main
    from apbv.video.footage import write_camera_video

    video = write_camera_video(tmp_path / "cam.mp4", seconds=1, fps=30, width=64, height=48,
                               gop_seconds=0.5)
    missing = tmp_path / "no-such-model"
    assert main(["plan", "--video", str(video), "--model", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "config.json" in err and str(missing) in err, err
