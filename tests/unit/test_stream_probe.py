"""apbv.capture: a followed file's end is measured from the last byte read, and a source is
probed before a stream opens on it (a file that is no video, an empty one, a link: refused at
once with the reason; the first packets of a streamable video: accepted)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from apbv.capture import FollowFile, SegmentDir, local_source
from apbv.capture.files import _TailReader
from apbv.synthetic.videos import write_test_video


def _timed_read(reader: _TailReader, size: int) -> tuple[bytes, float]:
    start = time.monotonic()
    data = reader.read(size)
    return data, time.monotonic() - start


def test_a_followed_files_end_counts_from_the_last_byte_read(tmp_path):
    """``end_after_s`` after the last byte read, however the reads fall: a decoder slow
    between two reads does not stretch it, and a demuxer that reads again after the end is
    answered at once (it used to wait end_after_s again, so an unreadable file failed after
    2x to 3x the stated time)."""
    path = tmp_path / "grows.ts"
    path.write_bytes(b"x" * 10)
    end_after_s = 1.0
    reader = _TailReader(os.open(path, os.O_RDONLY), threading.Event(), threading.Event(),
                         0.02, end_after_s)
    try:
        assert reader.read(10) == b"x" * 10
        time.sleep(end_after_s * 0.6)  # the decoder works on what it got
        data, waited = _timed_read(reader, 10)
        assert data == b"" and 0.2 <= waited < end_after_s * 0.7, waited  # the rest, not 1 s
        data, waited = _timed_read(reader, 10)  # asked again after the end
        assert data == b"" and waited < 0.3, waited
        with path.open("ab") as f:  # news after the end is still read
            f.write(b"y" * 4)
        assert reader.read(10) == b"y" * 4
    finally:
        reader.close()


def test_a_tail_reader_stops_at_max_bytes(tmp_path):
    path = tmp_path / "big.ts"
    path.write_bytes(b"z" * 100)
    reader = _TailReader(os.open(path, os.O_RDONLY), threading.Event(), threading.Event(),
                         0.02, None, max_bytes=30)
    try:
        assert reader.read(20) == b"z" * 20 and reader.read(-1) == b"z" * 10
        assert reader.read(20) == b""  # at once, though no end_after_s
    finally:
        reader.close()


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("probe")
    for ext in ("ts", "mp4", "mkv"):
        write_test_video(root / f"clip.{ext}", num_frames=8, fps=4.0, width=64, height=48)
    (root / "notes.mp4").write_text("hello, this is no video\n" * 200)
    (root / "empty.ts").write_bytes(b"")
    (root / "start.ts").write_bytes((root / "clip.ts").read_bytes()[:600])  # a recorder's start
    os.symlink(root / "clip.ts", root / "link.ts")
    (root / "segments").mkdir()
    os.symlink(root / "segments", root / "segments-link")
    return root


@pytest.mark.parametrize("name", ["clip.ts", "clip.mp4", "clip.mkv", "start.ts"])
def test_probe_accepts_the_first_packets_of_a_video(videos, name):
    FollowFile(videos / name, follow_symlinks=False).probe()


@pytest.mark.parametrize("name, text", [
    ("notes.mp4", "is not a video that can be followed: its first bytes (up to 8388608 read) "
                  "do not open as a streamable video format (MPEG-TS, fragmented MP4, "
                  "Matroska/WebM): InvalidDataError: Invalid data found when processing input"),
    ("empty.ts", "is empty: nothing to probe yet"),
    ("link.ts", "cannot be opened: it is a symbolic link, not followed"),
])
def test_probe_refuses_what_cannot_be_followed_at_once(videos, name, text):
    start = time.monotonic()
    with pytest.raises(ValueError) as exc:
        FollowFile(videos / name, follow_symlinks=False, end_after_s=30.0).probe()
    assert text in str(exc.value) and str(videos / name) in str(exc.value), str(exc.value)
    assert time.monotonic() - start < 5.0  # not after end_after_s


def test_probe_of_a_segment_directory_opens_it_as_reading_will(videos):
    local_source(str(videos / "segments"), follow_symlinks=False).probe()  # empty: fine
    with pytest.raises(ValueError, match="it is a symbolic link, not followed"):
        SegmentDir(videos / "segments-link", follow_symlinks=False).probe()
