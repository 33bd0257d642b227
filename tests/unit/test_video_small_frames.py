"""Small frames: decord cannot copy out the frames of some valid files (16x16, 24 pixels wide);
such a file is read by PyAV (the same frames on every rank), never refused as corrupt; without
PyAV the refusal says what it is."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from apbv.synthetic.videos import make_frame, write_test_video
from apbv.video import VideoMeta, VideoSpec, load_all_frames, load_rank_frames, probe
from apbv.video.decoders import _open

pytest.importorskip("decord")
pytest.importorskip("av")

SMALL = {"min_pixels": 4 * 28 * 28, "max_pixels": 16 * 28 * 28}


@pytest.fixture(scope="module")
def tiny_videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("small")
    return {f"{w}x{h}": write_test_video(d / f"v{w}x{h}.mp4", num_frames=16, fps=4.0, width=w,
                                         height=h, gop=4)
            for w, h in ((16, 16), (24, 40))}


@pytest.mark.parametrize("size", ["16x16", "24x40"])
def test_small_valid_video_is_read(tiny_videos: dict[str, Path], size: str) -> None:
    path = tiny_videos[size]
    width, height = map(int, size.split("x"))
    assert probe(VideoSpec(path)) == VideoMeta(16, 4.0, height, width)
    frames = load_all_frames(VideoSpec(path, fps=4.0, **SMALL))
    assert torch.equal(frames.frames,
                       load_all_frames(VideoSpec(path, fps=4.0, backend="pyav", **SMALL)).frames)
    # The decoded frames are the written ones (a lossy codec: compared in the mean).
    reader = _open(VideoSpec(path))
    try:
        native = reader.read(range(16)).numpy().astype(float)
    finally:
        reader.close()
    for index, frame in enumerate(native):
        truth = make_frame(index, fps=4.0, width=width, height=height).astype(float)
        assert np.abs(truth - frame).mean() < 12, index
    ranks = [load_rank_frames(VideoSpec(path, fps=4.0, **SMALL), r, 2).frames for r in (0, 1)]
    assert torch.equal(torch.cat(ranks), frames.frames)


def test_without_pyav_the_refusal_names_decord(monkeypatch: pytest.MonkeyPatch,
                                               tiny_videos: dict[str, Path]) -> None:
    monkeypatch.setitem(sys.modules, "av", None)  # makes `import av` fail
    path = str(tiny_videos["16x16"])
    with pytest.raises(ValueError) as err:
        probe(VideoSpec(path))
    message = str(err.value)
    assert message.startswith(f"decord cannot read the frames of video {path!r}: its frame "
                              "copy fails on some small frame widths"), message
    assert "not a corrupt file" in message and "PyAV reads it but is not installed" in message
    assert "truncated" not in message
