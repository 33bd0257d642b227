"""video.keyframe_split's settings and the split it gives (apbv.video.gop.frame_split), and the
[video] section's defaults loading at all (video.decode_threads unset)."""

from __future__ import annotations

import pytest

from apbv.config import VideoConfig, load_config
from apbv.plan import patch_ranges
from apbv.video import VideoSpec, plan_sampling
from apbv.video.gop import frame_split, keyframe_aligned_ranges, shared_intervals
from apbv.video.sampling import VideoMeta

KEYS = tuple(range(0, 1800, 60))  # 60 s at 30 fps, a keyframe every 2 s
META = VideoMeta(1800, 30.0, 1080, 1920, KEYS)


def test_video_section_defaults_load() -> None:
    """decode_threads unset (the cores divided by the ranks) is the default, not an error."""
    assert VideoConfig().decode_threads is None
    assert load_config("tiny_cpu", []).video.decode_threads is None
    assert VideoConfig(decode_threads=2).decode_threads == 2
    with pytest.raises(ValueError, match=r"video.decode_threads must be an integer >= 1"):
        VideoConfig(decode_threads=0)


def test_keyframe_split_setting_is_checked_and_reaches_the_spec() -> None:
    with pytest.raises(ValueError, match=r"video.keyframe_split must be"):
        VideoConfig(keyframe_split="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"keyframe_split must be true or false, got 1"):
        VideoSpec("v.mp4", keyframe_split=1)  # type: ignore[arg-type]
    assert VideoConfig(keyframe_split=True).spec("v.mp4").keyframe_split is True
    assert VideoConfig().spec("v.mp4").keyframe_split is False


def test_keyframe_split_needs_the_keyframe_index() -> None:
    meta = VideoMeta(1800, 30.0, 1080, 1920, None)  # a decoder that lists no keyframes
    with pytest.raises(ValueError, match=r"'v.mp4'.*keyframe_split needs the file's keyframe "
                                         r"index, which nvdec does not give"):
        plan_sampling(VideoSpec("v.mp4", fps=1.5, backend="nvdec", keyframe_split=True), meta)


def test_frame_split_follows_the_keyframes_only_when_asked() -> None:
    """1.5 fps (3 samples per keyframe interval): the balanced split on 4 ranks makes two ranks
    walk into one interval; the keyframe split does not, and each boundary moves by at most
    one patch; without the setting the split is the balanced one."""
    exact = plan_sampling(VideoSpec("v.mp4", fps=1.5), META)
    assert exact.keyframes is None and "keyframes" not in repr(exact)
    assert frame_split(exact, 4) == patch_ranges(exact.num_patches, 4)
    aligned = plan_sampling(VideoSpec("v.mp4", fps=1.5, keyframe_split=True), META)
    assert aligned.indices == exact.indices and aligned.keyframes == KEYS
    split = frame_split(aligned, 4)
    balanced = patch_ranges(aligned.num_patches, 4)
    assert split == tuple(keyframe_aligned_ranges(KEYS, aligned.indices, 4)) != balanced
    assert all(abs(a[0] - b[0]) <= 1 for a, b in zip(split, balanced)), (split, balanced)
    assert shared_intervals(KEYS, aligned.indices, balanced) > 0
    assert shared_intervals(KEYS, aligned.indices, split) == 0
    with pytest.raises(ValueError, match="patches"):  # fewer patches than ranks, as balanced
        frame_split(aligned, aligned.num_patches + 1)


def test_frame_by_frame_resize_gives_the_batch_resize_bits(monkeypatch) -> None:
    """resize_frames resizes large CPU frames one at a time: bit-equal to one batched call, for
    channels-last decoder frames and contiguous ones."""
    import torch

    import apbv.video.load as load

    gen = torch.Generator().manual_seed(0)
    decoded = torch.randint(0, 256, (3, 270, 480, 3), dtype=torch.uint8, generator=gen)
    for frames in (decoded.permute(0, 3, 1, 2), decoded.permute(0, 3, 1, 2).contiguous()):
        assert frames[0].numel() > load.RESIZE_ONE_BY_ONE
        one_by_one = load.resize_frames(frames, (84, 140))
        monkeypatch.setattr(load, "RESIZE_ONE_BY_ONE", frames[0].numel())  # one batched call
        batched = load.resize_frames(frames, (84, 140))
        monkeypatch.undo()
        assert one_by_one.shape == batched.shape == (3, 3, 84, 140)
        assert torch.equal(one_by_one, batched)
