"""What a new user runs first: ``make-test-video`` into a directory that does not exist yet,
``make-tiny-model`` without its extra (one error line naming the extra, no traceback)."""

from __future__ import annotations

from pathlib import Path

import av

from apbv.__main__ import main

SMALL = ["--seconds", "1", "--fps", "2", "--width", "32", "--height", "32"]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_make_test_video_creates_parent_directories(tmp_path: Path, capsys) -> None:
    out = tmp_path / "media" / "day 1" / "clip.mp4"
    assert main(["make-test-video", "--out", str(out), *SMALL]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    with av.open(str(out)) as container:
        assert sum(1 for _ in container.decode(video=0)) == 2


def test_make_test_video_with_a_file_in_the_way(tmp_path: Path, capsys) -> None:
    (tmp_path / "media").write_text("not a directory")
    out = tmp_path / "media" / "clip.mp4"
    assert main(["make-test-video", "--out", str(out), *SMALL]) == 2
    line = _one_error_line(capsys)
    assert str(out) in line and "a file is in the way" in line
