"""apbv.capture capture side: sources that grow, end, stall, fail or are pushed, and the capture
thread's sampling, drop policies, stats and shutdown. Tiny videos (64x48, a few frames)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from apbv.capture import (
    Capture,
    FollowFile,
    PushSource,
    SegmentDir,
    Source,
    UrlSource,
    stream_frame_size,
)
from apbv.synthetic.videos import write_test_video

SMALL = 56 * 56  # max_pixels: every test frame is resized to 56 x 56


def _video(path: Path, num_frames: int, seed: int = 0) -> Path:
    return write_test_video(path, num_frames=num_frames, fps=4.0, width=64, height=48, seed=seed)


def _wait(predicate, what: str, limit_s: float = 15.0) -> None:
    """Poll ``predicate`` until it holds; fail (not hang) after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _drain(capture: Capture, limit_s: float = 15.0) -> list:
    """Every frame until the capture ends."""
    frames = []
    deadline = time.monotonic() + limit_s
    while not (capture.stats()["ended"] and capture.stats()["buffered"] == 0):
        assert time.monotonic() < deadline, f"capture did not end: {capture.stats()}"
        frames += capture.take(timeout=1.0)
    return frames


def _times(frames) -> list[float]:
    return [round(f.timestamp, 6) for f in frames]


def test_stream_frame_size_is_the_per_frame_rule_without_a_total_budget():
    assert stream_frame_size(48, 64) == (280, 392)  # raised to qwen-vl-utils' 128-token floor
    assert stream_frame_size(48, 64, max_pixels=SMALL) == (56, 56)
    assert stream_frame_size(480, 640) == (476, 644)
    # 768 tokens per frame at most, however long the stream runs.
    assert stream_frame_size(1080, 1920) == (560, 1008)  # 720 tokens of 28 x 28 <= 768
    with pytest.raises(ValueError, match="max_pixels"):
        stream_frame_size(48, 64, min_pixels=5000, max_pixels=4000)
    with pytest.raises(ValueError, match="height must be an integer"):
        stream_frame_size(0, 64)


def test_follow_file_yields_frames_as_the_file_grows(tmp_path):
    data = _video(tmp_path / "full.ts", 24).read_bytes()  # H.264 with B-frames
    live = tmp_path / "live.ts"
    half = len(data) // 2
    live.write_bytes(data[:half])
    source = FollowFile(live)  # follows until finish()
    capture = Capture(source, max_pixels=SMALL)
    try:
        early = capture.take(timeout=15.0)
        assert early, capture.stats()
        assert not capture.stats()["ended"]  # waiting for the writer
        with live.open("ab") as f:
            f.write(data[half:])
        source.finish()
        frames = early + _drain(capture)
    finally:
        capture.close()
    assert 1 <= len(early) < 24  # the rest needed the second half
    assert _times(frames) == [0.25 * i for i in range(24)]
    assert all(f.image.shape == (3, 56, 56) and f.image.dtype == torch.uint8 for f in frames)
    stats = capture.stats()
    assert (stats["frames_decoded"], stats["frames_delivered"], stats["error"]) == (24, 24, None)


def test_follow_file_samples_to_the_stream_fps(tmp_path):
    path = _video(tmp_path / "clip.ts", 12)
    capture = Capture(FollowFile(path, end_after_s=0.2), fps=1.5, max_pixels=SMALL)
    frames = _drain(capture)
    # Sample times 0, 2/3, 4/3, 2, 8/3: the first native frame at or after each.
    assert _times(frames) == [0.0, 0.75, 1.5, 2.0, 2.75]
    assert capture.stats()["frames_decoded"] == 12


def test_segment_dir_skips_a_corrupt_segment_and_goes_on(tmp_path):
    _video(tmp_path / "seg_000.mp4", 4, seed=1)
    (tmp_path / "seg_001.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 4)
    _video(tmp_path / "seg_002.mp4", 4, seed=2)
    (tmp_path / "notes.txt").write_text("not a segment")
    source = SegmentDir(tmp_path, settle_s=0.1, end_after_s=0.3)
    capture = Capture(source, max_pixels=SMALL)
    frames = _drain(capture)
    stats = capture.stats()
    # The second good segment continues where the first ended (4 frames at 4 fps: 1.0 s).
    assert _times(frames) == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75]
    assert (stats["segments_done"], stats["segments_failed"]) == (2, 1)
    assert stats["errors"] == [
        "seg_001.mp4: InvalidDataError: Invalid data found when processing input"]
    assert stats["ended"] and stats["error"] is None


def test_segment_dir_can_refuse_to_follow_symbolic_links(tmp_path):
    outside = _video(tmp_path / "outside.mp4", 4, seed=3)
    segments = tmp_path / "segments"
    segments.mkdir()
    _video(segments / "seg_000.mp4", 4, seed=1)
    os.symlink(outside, segments / "seg_001.mp4")
    source = SegmentDir(segments, settle_s=0.1, end_after_s=0.3, follow_symlinks=False)
    capture = Capture(source, max_pixels=SMALL)
    assert _times(_drain(capture)) == [0.0, 0.25, 0.5, 0.75]  # the linked segment is not read
    stats = capture.stats()
    assert (stats["segments_done"], stats["segments_failed"]) == (1, 0)
    assert stats["errors"] == ["seg_001.mp4: a symbolic link, not followed (skipped)"]
    followed = Capture(SegmentDir(segments, settle_s=0.1, end_after_s=0.3), max_pixels=SMALL)
    assert len(_drain(followed)) == 8  # by default a link is a segment like any other


def test_segment_dir_does_not_open_a_link_swapped_in_after_the_listing(tmp_path):
    """A writer who replaces a listed segment with a link before it is opened gets a failed
    segment, not the link's target; a directory that is itself a link, or has one above it,
    is refused, and so is a followed file with a link above it."""
    outside = _video(tmp_path / "outside.mp4", 4, seed=3)
    segments = tmp_path / "segments"
    segments.mkdir()
    _video(segments / "seg_000.mp4", 4, seed=1)
    _video(segments / "seg_001.mp4", 4, seed=2)
    source = SegmentDir(segments, settle_s=0.0, end_after_s=0.3, follow_symlinks=False)
    listing, calls = source._listing, []

    def listing_then_swap(directory: int) -> list[tuple[str, int]]:
        found = listing(directory)  # seg_001 is still a regular file here
        calls.append(found)
        if len(calls) == 2:  # seg_000 has been read; seg_001 is the one to open next
            os.remove(segments / "seg_001.mp4")
            os.symlink(outside, segments / "seg_001.mp4")
        return found

    source._listing = listing_then_swap
    capture = Capture(source, max_pixels=SMALL)
    assert _times(_drain(capture)) == [0.0, 0.25, 0.5, 0.75]  # seg_000 only
    stats = capture.stats()
    assert "seg_001.mp4" in dict(calls[1]), calls  # listed as a regular file, then swapped
    assert (stats["segments_done"], stats["segments_failed"]) == (1, 1), stats
    assert stats["errors"] == ["seg_001.mp4: OSError: Too many levels of symbolic links",
                               "seg_001.mp4: a symbolic link, not followed (skipped)"]

    linked_dir = tmp_path / "linked"
    os.symlink(segments, linked_dir)
    refused = Capture(SegmentDir(linked_dir, follow_symlinks=False), max_pixels=SMALL)
    assert _drain(refused) == []
    assert refused.stats()["error"] == (f"segment directory {str(linked_dir)!r} cannot be "
                                        "opened: it is a symbolic link, not followed")
    # A link above the directory, or above a followed file, is refused as well.
    os.symlink(tmp_path, tmp_path / "up")
    for source, what, path in (
            (SegmentDir(tmp_path / "up" / "segments", follow_symlinks=False),
             "segment directory", tmp_path / "up" / "segments"),
            (FollowFile(tmp_path / "up" / "outside.mp4", end_after_s=0.3,
                        follow_symlinks=False), "followed video", tmp_path / "up" / "outside.mp4")):
        refused = Capture(source, max_pixels=SMALL)
        assert _drain(refused) == []
        assert refused.stats()["error"] == (
            f"{what} {str(path)!r} cannot be opened: {str(tmp_path / 'up')!r} on its path is "
            "a symbolic link, not followed")
    followed = Capture(FollowFile(tmp_path / "up" / "outside.mp4", end_after_s=0.3),
                       max_pixels=SMALL)
    assert len(_drain(followed)) == 4  # by default the link is followed


def test_segment_dir_takes_a_segment_only_when_a_newer_one_exists_or_it_settles(tmp_path):
    _video(tmp_path / "b.mp4", 4)
    source = SegmentDir(tmp_path, order="mtime", settle_s=60.0)
    capture = Capture(source, max_pixels=SMALL)
    try:
        _wait(lambda: capture.stats()["idle_s"] > 0.3, "the source to look at b.mp4")
        assert capture.stats()["frames_decoded"] == 0  # b.mp4 may still be being written
        _video(tmp_path / "a.mp4", 2)  # written later: next in mtime order, though named "a"
        _wait(lambda: capture.stats()["segments_done"] == 1, "b.mp4 to be taken")
    finally:
        capture.close()
    stats = capture.stats()
    assert (stats["frames_decoded"], stats["segments_done"]) == (4, 1)  # a.mp4 is not settled
    assert _times(capture.take()) == [0.0, 0.25, 0.5, 0.75]


def test_segment_dir_and_capture_refuse_bad_settings(tmp_path):
    with pytest.raises(ValueError, match="order must be one of"):
        SegmentDir(tmp_path, order="size")
    with pytest.raises(ValueError, match="does not exist"):
        SegmentDir(tmp_path / "missing")
    missing = tmp_path / "missing.ts"
    capture = Capture(FollowFile(missing))
    assert capture.take(timeout=30.0) == []
    assert capture.stats()["error"] == (f"followed video {str(missing)!r} does not exist or is "
                                        "not a file")
    with pytest.raises(ValueError, match="drop must be one of"):
        Capture(PushSource(), drop="oldest")
    with pytest.raises(ValueError, match="fps must be a finite number of frames per second > 0"):
        Capture(PushSource(), fps=0.0)
    with pytest.raises(ValueError, match="k must be an integer >= 2"):
        Capture(PushSource(), drop="every_k", k=1)


def test_an_ended_source_leaves_its_frames_then_nothing(tmp_path):
    path = _video(tmp_path / "clip.mp4", 6)
    capture = Capture(UrlSource(str(path)), max_pixels=SMALL)
    _wait(lambda: capture.stats()["ended"], "the end of the file")
    stats = capture.stats()
    assert (stats["ended"], stats["error"], stats["stalled"], stats["buffered"]) == (
        True, None, False, 6)
    assert _times(capture.take(4)) == [0.0, 0.25, 0.5, 0.75]
    assert _times(capture.take(timeout=30.0)) == [1.0, 1.25]
    start = time.monotonic()
    assert capture.take(timeout=30.0) == []  # ended and empty: no wait
    assert time.monotonic() - start < 5.0
    assert capture.stats()["frames_delivered"] == 6


def _frames(values, height=48, width=64) -> torch.Tensor:
    """uint8 (F, 3, H, W), frame i filled with values[i]."""
    return torch.tensor(values, dtype=torch.uint8).view(-1, 1, 1, 1).expand(
        -1, 3, height, width).contiguous()


def test_a_stall_is_reported_and_give_up_ends_the_capture():
    source = PushSource()
    source.push(_frames([10, 20]), fps=4.0)
    capture = Capture(source, stall_s=0.5, max_pixels=SMALL)
    try:
        _wait(lambda: capture.stats()["stalled"], "the stalled flag")
        stats = capture.stats()
        assert (stats["ended"], stats["error"], stats["frames_decoded"]) == (False, None, 2)
        source.push(_frames([30]), fps=4.0)
        _wait(lambda: not capture.stats()["stalled"], "the stall to clear")
    finally:
        capture.close()

    source = PushSource()
    capture = Capture(source, stall_s=0.1, give_up_s=0.3, max_pixels=SMALL)
    assert capture.take(timeout=30.0) == []  # returns once the capture gives up
    stats = capture.stats()
    assert stats["ended"] and not stats["stalled"]
    assert stats["error"].startswith("source stalled: no frame for ")
    assert "give_up_s=0.3" in stats["error"] and stats["errors"] == [stats["error"]]
    source.end()
    with pytest.raises(ValueError, match="push after end"):
        source.push(_frames([1]), fps=4.0)


def test_drop_newest_keeps_the_newest_frames_and_counts_the_rest():
    source = PushSource()
    source.push(_frames([10 * i for i in range(10)]), fps=10.0)
    source.end()
    capture = Capture(source, capacity=4, drop="newest", max_pixels=SMALL)
    _wait(lambda: capture.stats()["ended"], "the pushed frames")
    assert capture.stats()["ingest_lag_s"] == pytest.approx(0.9)
    frames = capture.take()
    stats = capture.stats()
    assert _times(frames) == [0.6, 0.7, 0.8, 0.9]
    assert [int(f.image[0, 0, 0]) for f in frames] == [60, 70, 80, 90]
    assert (stats["frames_sampled"], stats["frames_dropped"], stats["frames_delivered"]) == (
        10, 6, 4)
    assert stats["ingest_lag_s"] == 0.0


def test_drop_every_k_thins_the_backlog_and_counts_the_rest():
    source = PushSource()
    # Channels last this time; 20 fps sampled to 10 fps keeps every other pushed frame.
    values = list(range(0, 200, 10))
    source.push(_frames(values).permute(0, 2, 3, 1).numpy(), fps=20.0)
    source.end()
    capture = Capture(source, fps=10.0, capacity=4, drop="every_k", k=2, max_pixels=SMALL)
    _wait(lambda: capture.stats()["ended"], "the pushed frames")
    frames = capture.take()
    stats = capture.stats()
    # Sampled: t = 0.0, 0.1, ..., 0.9. At a full buffer [a, b, c, d] -> [a, c] + new:
    # 0-3; [0, .2, .4]; [0, .2, .4, .5]; [0, .4, .6]; ...; [0, .6, .8, .9].
    assert _times(frames) == [0.0, 0.6, 0.8, 0.9]
    assert [int(f.image[0, 0, 0]) for f in frames] == [0, 120, 160, 180]
    assert (stats["frames_decoded"], stats["frames_sampled"], stats["frames_dropped"],
            stats["frames_delivered"]) == (20, 10, 6, 4)


def test_push_refuses_bad_frames_and_timestamps():
    source = PushSource()
    with pytest.raises(ValueError, match="uint8"):
        source.push(np.zeros((2, 3, 8, 8), dtype=np.float32), fps=1.0)
    with pytest.raises(ValueError, match="layout="):
        source.push(torch.zeros((1, 3, 8, 3), dtype=torch.uint8), fps=1.0)
    with pytest.raises(ValueError, match="exactly one of timestamps and fps"):
        source.push(_frames([1]))
    source.push(_frames([1, 2]), [0.5, 1.0])
    with pytest.raises(ValueError, match="strictly increasing"):
        source.push(_frames([3]), [1.0])


class _Stuck(Source):
    """A source blocked inside a call that ignores the stop event (until released)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def frames(self, stop):
        self.release.wait()
        return iter(())


def test_close_returns_promptly_even_while_the_source_is_blocked():
    waiting = Capture(PushSource(), max_pixels=SMALL)  # waits for pushes, checking stop
    stuck_source = _Stuck()
    stuck = Capture(stuck_source, max_pixels=SMALL)
    try:
        start = time.monotonic()
        waiting.close()
        stuck.close(join_s=0.2)
        assert time.monotonic() - start < 5.0
        assert not waiting._thread.is_alive()
        assert stuck.stats()["ended"] and stuck.stats()["closed"]
        assert stuck.take(timeout=30.0) == []
    finally:
        stuck_source.release.set()


def test_a_bad_url_is_a_clear_error_not_a_hang():
    with pytest.raises(ValueError, match="url must be a non-empty str"):
        UrlSource("")
    url = "rtsp://127.0.0.1:1/none"  # nothing listens on port 1: refused at once
    capture = Capture(UrlSource(url, open_timeout_s=2.0, read_timeout_s=2.0))
    assert capture.take(timeout=30.0) == []
    stats = capture.stats()
    assert stats["ended"] and stats["frames_decoded"] == 0
    assert stats["error"].startswith(f"video URL {url!r} cannot be opened by PyAV: ")
