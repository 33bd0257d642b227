"""apbv.video.gop: decode work of a frame split, and the keyframe-aligned split (pure)."""

from __future__ import annotations

import torch

from apbv.plan import patch_ranges
from apbv.video.gop import (
    Walk,
    keyframe_aligned_ranges,
    rank_walks,
    shared_intervals,
    walk,
    walked_frames,
)
from apbv.video.sampling import snap_to_keyframes


def _sampled(total: int, n: int) -> list[int]:
    """The runtime's rule: linspace over the frames, rounded half to even."""
    return torch.linspace(0, total - 1, n, dtype=torch.float32).round().long().tolist()


def test_walked_frames_counts_from_each_keyframe_to_its_last_sample() -> None:
    keys = [0, 60, 120]
    assert walked_frames(keys, [0]) == 1
    assert walked_frames(keys, [10, 45]) == 46  # one interval, up to 45
    assert walked_frames(keys, [45, 70, 130]) == 46 + 11 + 11
    assert walked_frames(keys, []) == 0
    assert walk(keys, [45, 70, 130]) == Walk(46 + 11 + 11, 3)
    assert walk(keys, [10, 45]) == Walk(46, 1) and walk(keys, []) == Walk(0, 0)


def test_keyframe_aligned_split_for_every_rank_count() -> None:
    """1..8 ranks, camera-like structures (30 fps, keyframes every 1-4 s, 1-2 fps sampled,
    awkward lengths): the aligned split covers every patch in order, each rank gets between
    1 and the balanced maximum + 1 patches, each boundary moves by at most one patch, no
    keyframe interval is walked by two ranks unless that boundary could not move, and the
    ranks walk no more frames in all than the balanced split's."""
    moved_somewhere = False
    for total, gop, n in ((1800, 60, 120), (1799, 30, 62), (3000, 120, 100), (901, 45, 64)):
        keys = list(range(0, total, gop))
        indices = _sampled(total, n)
        for world in range(1, 9):
            balanced = patch_ranges(n // 2, world)
            aligned = keyframe_aligned_ranges(keys, indices, world)
            assert aligned[0][0] == 0 and aligned[-1][1] == n // 2
            assert all(a[1] == b[0] for a, b in zip(aligned, aligned[1:]))
            most = max(e - s for s, e in balanced) + 1
            assert all(1 <= e - s <= most for s, e in aligned), (aligned, balanced)
            assert all(abs(a[0] - b[0]) <= 1 for a, b in zip(aligned, balanced))
            moved_somewhere |= aligned != balanced
            for i in range(1, world):
                frame = 2 * aligned[i][0]
                if aligned[i][0] == balanced[i][0]:
                    continue
                assert indices[frame - 1] // gop != indices[frame] // gop, (world, i)
            assert shared_intervals(keys, indices, aligned) <= shared_intervals(
                keys, indices, balanced)
            assert sum(w.frames for w in rank_walks(keys, indices, aligned)) <= sum(
                w.frames for w in rank_walks(keys, indices, balanced))
    assert moved_somewhere


def test_aligned_split_removes_every_shared_interval_when_it_can() -> None:
    """Keyframes every 2 s at 30 fps, 1.5 fps sampled (3 samples per interval, so every
    third patch boundary is clean): every boundary finds a clean place within one patch, so
    no interval is walked by two ranks; the balanced split shares some."""
    keys = list(range(0, 1800, 60))
    indices = [20 * i for i in range(90)]
    for world in (2, 4, 6, 8):
        assert shared_intervals(keys, indices, patch_ranges(45, world)) > 0, world
        assert shared_intervals(keys, indices,
                                keyframe_aligned_ranges(keys, indices, world)) == 0, world


def test_snap_to_keyframes_moves_only_within_the_tolerance() -> None:
    keys = (0, 60, 120)
    indices = [0, 14, 15, 31, 45, 89, 90, 91, 130]
    out, moved = snap_to_keyframes(indices, keys, 15)
    # 15 frames of tolerance: 14 and 15 go to 0, 45 to 60; 90 is a tie (30 from 60 and 120).
    assert out == [0, 0, 0, 31, 60, 89, 90, 91, 120]
    assert moved == ((1, 14, 0), (2, 15, 0), (4, 45, 60), (8, 130, 120))
    assert out == sorted(out)
    tie, _ = snap_to_keyframes([90], keys, 30)
    assert tie == [60]  # the earlier keyframe on a tie
    assert snap_to_keyframes(indices, keys, 0.5) == (indices, ())
