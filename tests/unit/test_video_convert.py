"""The per-frame conversion of ``video.decode=needed`` (apbv.video.bicubic.resize_frame_into): the
pixels of the earlier stacked-chunk resize (resize_frames), bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchvision")

from apbv.video import bicubic, load


@pytest.mark.parametrize("source, size", [
    ((1080, 1920), (84, 140)),   # camera footage under the benchmark's pixel budget
    ((720, 1280), (364, 644)),   # a milder downscale
    ((48, 64), (28, 56)),        # under RESIZE_ONE_BY_ONE: resize_frames resizes the batch
    ((20, 30), (56, 84)),        # an upscale
    ((56, 84), (56, 84)),        # the asked size: returned unchanged
])
def test_resize_frame_into_equals_resize_frames(source: tuple[int, int],
                                                size: tuple[int, int]) -> None:
    """Random pixels (every level, sharp edges everywhere) as a decoder hands them over,
    uint8 (H, W, 3): the planar float32 scratch gives the bits of the channels-last batch."""
    gen = torch.Generator().manual_seed(sum(source))
    decoded = torch.randint(0, 256, (2, *source, 3), dtype=torch.uint8, generator=gen)
    expected = load.resize_frames(decoded.permute(0, 3, 1, 2), size, fast=False)
    scratch = torch.full((1, 3, *source), float("nan"))  # reused across both frames
    out = torch.empty((2, 3, *size), dtype=torch.uint8)
    for k in range(2):
        bicubic.resize_frame_into(decoded[k], out[k], scratch)
    assert torch.equal(out, expected)


def test_needed_decode_resizes_each_frame_as_decoded(tmp_path) -> None:
    """decode=needed never stacks a chunk of decoded frames (the reader's read is not called);
    decode=all keeps the earlier conversion; the same frames either way."""
    pytest.importorskip("av")
    from apbv.video import VideoSpec, load_rank_frames
    from apbv.video.decoders import _PyAVReader
    from apbv.video.footage import write_camera_video

    path = write_camera_video(tmp_path / "c.mp4", seconds=1, fps=30, width=192, height=108,
                              gop_seconds=0.5, bframes=2)
    reads: list[str] = []
    original = _PyAVReader.read

    def read(self, indices):  # noqa: ANN001, ANN202
        reads.append("needed" if self.per_frame else "all")
        return original(self, indices)

    frames = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_PyAVReader, "read", read)
        for decode in ("needed", "all"):
            spec = VideoSpec(path, nframes=8, backend="pyav", decode=decode,
                             min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28)
            frames[decode] = load_rank_frames(spec, 0, 1).frames
    assert set(reads) == {"all"}, reads
    assert torch.equal(frames["needed"], frames["all"])
