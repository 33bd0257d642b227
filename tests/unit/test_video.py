"""apbv.video and apbv.synthetic: parity with qwen-vl-utils, frame parallelism, decoders, errors.

Needs the ``video`` extra (decord, PyAV, qwen-vl-utils); skipped without it. Videos are written
into a temporary directory with apbv.synthetic.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("decord")
pytest.importorskip("av")
pytest.importorskip("qwen_vl_utils")

import apbv.video
import apbv.video.load
from apbv.plan import patch_ranges
from apbv.synthetic.videos import make_frame, write_test_video
from apbv.video import (
    BACKENDS,
    TEMPORAL_PATCH_SIZE,
    VideoMeta,
    VideoSpec,
    load_all_frames,
    load_rank_frames,
    plan_sampling,
    probe,
)

# Small targets keep the resize cheap: 4..16 tokens of 28x28 pixels per frame.
SMALL = {"min_pixels": 4 * 28 * 28, "max_pixels": 16 * 28 * 28}


@pytest.fixture(scope="module")
def vp():
    from qwen_vl_utils import vision_process

    return vision_process


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    d = tmp_path_factory.mktemp("videos")
    return SimpleNamespace(
        # 84x56 is a multiple of 28: frames can be kept at their native size.
        main=write_test_video(d / "main.mp4", num_frames=60, fps=10, width=84, height=56, gop=6),
        odd=write_test_video(d / "odd.mp4", num_frames=36, fps=12, width=70, height=46,
                             codec="mpeg4", gop=5),
        mkv=write_test_video(d / "odd.mkv", num_frames=30, fps=7.5, width=64, height=48, gop=4),
        faststart=write_test_video(d / "faststart.mp4", num_frames=60, fps=10, width=84,
                                   height=56, gop=6, faststart=True),
        dir=d,
    )


# ---------------------------------------------------------------------------------------------
# Sampling parity with qwen-vl-utils.


class _FakeDecord:
    """Stands in for decord.VideoReader inside qwen-vl-utils' reader: any length, any fps."""

    total = 0
    fps = 0.0

    def __init__(self, path: str, *args: object, **kwargs: object) -> None:
        pass

    def __len__(self) -> int:
        return self.total

    def get_avg_fps(self) -> float:
        return self.fps

    def get_batch(self, idx: list[int]) -> SimpleNamespace:
        return SimpleNamespace(asnumpy=lambda: np.zeros((len(idx), 1, 1, 3), np.uint8))


SAMPLING_MODES = [
    {}, {"fps": 0.5}, {"fps": 1.0}, {"fps": 3.3}, {"fps": 30.0}, {"fps": 240.0},
    {"nframes": 2}, {"nframes": 3}, {"nframes": 5}, {"nframes": 7}, {"nframes": 16},
    {"nframes": 768}, {"nframes": 1001},
    {"fps": 2.0, "min_frames": 8}, {"max_frames": 16}, {"fps": 0.1, "min_frames": 1,
                                                         "max_frames": 2},
]
RANGES = [(None, None), (0.0, None), (1.3, None), (None, 4.2), (0.5, 10.0), (100.0, None),
          (2.0, 2.01)]


def test_sampling_matches_qwen_vl_utils(monkeypatch: pytest.MonkeyPatch, caplog, vp) -> None:
    """Indices, sample fps and errors equal qwen-vl-utils' decord reader on 7392 cases."""
    caplog.set_level(logging.ERROR, logger=vp.__name__)  # its "nframes > total_frames" warnings
    monkeypatch.setitem(sys.modules, "decord", SimpleNamespace(VideoReader=_FakeDecord))
    compared = errors = 0
    for total, fps in itertools.product(
        [1, 2, 3, 5, 9, 17, 60, 301, 1000, 7777, 100003], [1.0, 7.5, 23.976, 29.97, 30.0, 60.0]
    ):
        _FakeDecord.total, _FakeDecord.fps = total, fps
        meta = VideoMeta(total, fps, 46, 70)
        for mode, (start, end) in itertools.product(SAMPLING_MODES, RANGES):
            spec = VideoSpec("x.mp4", video_start=start, video_end=end, **mode)
            try:
                _, info, ref_fps = vp._read_video_decord(spec.qwen_element())
            except ValueError as err:
                with pytest.raises(ValueError, match="x.mp4") as ours:
                    plan_sampling(spec, meta)
                assert str(err) in str(ours.value)
                errors += 1
                continue
            got = plan_sampling(spec, meta)
            case = (total, fps, mode, start, end)
            assert list(got.indices) == info["frames_indices"], case
            assert got.sample_fps == ref_fps, case
            assert got.num_frames % TEMPORAL_PATCH_SIZE == 0, case
            compared += 1
    assert compared > 3000 and errors > 3000, (compared, errors)  # both paths exercised


RESIZE_PIXELS = [
    {}, {"min_pixels": 50_000}, {"max_pixels": 200_000}, {"total_pixels": 20_000 * 784},
    {"min_pixels": 4 * 784, "max_pixels": 16 * 784}, {"total_pixels": 10**6, "min_pixels": 10_000},
    {"max_pixels": 10**7},
]


def test_resize_target_matches_qwen_vl_utils(monkeypatch: pytest.MonkeyPatch, vp) -> None:
    """The ported per-frame pixel cap + smart_resize equal fetch_video's, frames not decoded."""
    sizes: list[list[int]] = []

    def fake_resize(video: torch.Tensor, size: list[int], **kwargs: object) -> torch.Tensor:
        sizes.append(size)
        return torch.zeros(1)

    def read(ele: dict) -> tuple:  # an (n, 3, H, W) view of one zero pixel: no memory
        n, h, w = ele["nframes"], ele["h"], ele["w"]
        return torch.zeros(1, 3, 1, 1, dtype=torch.uint8).expand(n, 3, h, w), {}, 2.0

    monkeypatch.setattr(vp, "transforms", SimpleNamespace(functional=SimpleNamespace(
        resize=fake_resize)))
    monkeypatch.setattr(vp, "get_video_reader_backend", lambda: "decord")
    monkeypatch.setitem(vp.VIDEO_READER_BACKENDS, "decord", read)
    compared = errors = zero = 0
    for (h, w), n, pixels in itertools.product(
        [(46, 70), (56, 84), (240, 320), (360, 640), (720, 1280), (1080, 1920), (2160, 3840),
         (1920, 1080), (100, 30), (28, 28), (15, 2000), (10, 2100)],
        [2, 4, 16, 64, 256, 768, 2048],
        [*RESIZE_PIXELS, {"resized_height": 50, "resized_width": 90},
         {"resized_height": 1, "resized_width": 300}],
    ):
        spec = VideoSpec("x.mp4", nframes=n, **pixels)
        meta = VideoMeta(n, 30.0, h, w)
        try:
            vp.fetch_video({**spec.qwen_element(), "h": h, "w": w})
        except ValueError:
            with pytest.raises(ValueError, match="x.mp4.*aspect ratio"):
                plan_sampling(spec, meta)
            errors += 1
            continue
        if 0 in sizes[-1]:  # torchvision would fail on the 0-pixel side: ours fails first
            with pytest.raises(ValueError, match=rf"x.mp4.*{w}x{h} would be resized to "
                                                 rf"{sizes[-1][1]}x{sizes[-1][0]} pixels"):
                plan_sampling(spec, meta)
            zero += 1
            continue
        got = plan_sampling(spec, meta)
        assert [got.resized_height, got.resized_width] == sizes[-1], (h, w, n, pixels)
        assert got.grid_thw == (n // 2, got.resized_height // 14, got.resized_width // 14)
        compared += 1
    assert compared > 500 and errors > 0 and zero > 0, (compared, errors, zero)


def test_max_pixels_below_default_min_pixels(monkeypatch: pytest.MonkeyPatch, vp,
                                             tmp_path: Path) -> None:
    """max_pixels=50176 with the tiny_cpu preset's video settings: the cap wins.

    qwen-vl-utils 0.0.14 fails on this element (smart_resize asserts max_pixels >= its default
    min_pixels, 100352); ours equals fetch_video with min_pixels lowered to max_pixels, and
    equals fetch_video on the bare element should a qwen-vl-utils release accept it."""
    from apbv.config import load_config

    monkeypatch.setattr(vp, "get_video_reader_backend", lambda: "decord")
    video = write_test_video(tmp_path / "v.mp4", num_frames=40, fps=4.0, width=448, height=336)
    cfg = load_config("tiny_cpu", ["video.max_pixels=50176"])
    spec = cfg.video.spec(str(video))
    assert spec.max_pixels == 50176 and spec.min_pixels is None
    element = spec.qwen_element()
    try:
        ref = vp.fetch_video(element)
    except AssertionError:
        ref = vp.fetch_video({**element, "min_pixels": 50176})
    got = load_all_frames(spec)
    assert (got.sampling.resized_height, got.sampling.resized_width) == (168, 252)
    assert got.frames.shape == ref.shape == (20, 3, 168, 252)
    assert torch.equal(got.frames.float(), ref)
    assert got.sampling.resized_height * got.sampling.resized_width <= 50176
    # 224x224 frames (the CLI test video): 50176 pixels exactly, kept at their size.
    small = write_test_video(tmp_path / "s.mp4", num_frames=8, fps=4.0, width=224, height=224)
    assert load_all_frames(cfg.video.spec(str(small))).frames.shape[-2:] == (224, 224)
    # Explicit min_pixels above max_pixels stays an error (qwen-vl-utils fails there too).
    with pytest.raises(ValueError, match=r"max_pixels must be >= min_pixels \(100352\), got 50176"):
        VideoSpec(video, min_pixels=100352, max_pixels=50176)


@pytest.mark.parametrize("size, pixels", [
    ((2000, 12), {"max_pixels": 20_000}),  # thin: 12 pixels high, 167:1
    ((400, 300), {"max_pixels": 500}),  # a max_pixels below one 28x28 patch
    ((600, 60), {"total_pixels": 20 * 784, "min_pixels": 16}),  # tiny total budget
])
def test_frames_resized_to_zero_pixels(tmp_path: Path, size, pixels) -> None:
    """A side that would become 0 pixels: ValueError naming the video, its size and settings,
    before any decoding (a RuntimeError inside torchvision's resize otherwise)."""
    width, height = size
    meta = VideoMeta(40, 10.0, height, width)
    spec = VideoSpec("thin.mp4", nframes=20, **pixels)
    with pytest.raises(ValueError, match=rf"'thin.mp4': frames of {width}x{height} would be "
                                         r"resized to \d+x\d+ pixels \(min_pixels=") as err:
        plan_sampling(spec, meta)
    message = str(err.value)
    assert re.search(r"resized to (0x\d+|\d+x0) pixels", message), message
    assert "max_pixels=" in message and "total_pixels=" in message, message


@pytest.mark.parametrize("kwargs", [
    {},
    {"fps": 4.0, "video_start": 0.7, "video_end": 4.9},
    {"nframes": 8, **SMALL},
    {"total_pixels": 30 * 28 * 28, "fps": 5.0},
])
def test_frames_equal_fetch_video(monkeypatch: pytest.MonkeyPatch, vp, videos, kwargs) -> None:
    """End to end on a real file: qwen-vl-utils' fetch_video (decord reader) == load_all_frames."""
    def no_fallback(ele: dict) -> None:
        raise AssertionError("qwen-vl-utils fell back to torchvision")

    monkeypatch.setattr(vp, "get_video_reader_backend", lambda: "decord")
    monkeypatch.setitem(vp.VIDEO_READER_BACKENDS, "torchvision", no_fallback)
    # One frame per decode + resize chunk here; qwen-vl-utils resizes all frames at once.
    monkeypatch.setattr(apbv.video.load, "DECODE_CHUNK_ELEMENTS", 1)
    spec = VideoSpec(videos.main, **kwargs)
    (ref, info), ref_fps = vp.fetch_video(spec.qwen_element(), return_video_sample_fps=True,
                                          return_video_metadata=True)
    got = load_all_frames(spec)
    assert list(got.indices) == info["frames_indices"]
    assert got.sampling.sample_fps == ref_fps
    assert got.frames.dtype == torch.uint8 and got.frames.shape == ref.shape
    assert torch.equal(got.frames.float(), ref), (got.frames.float() - ref).abs().max()
    assert got.sampling.second_per_grid_t == pytest.approx(2 / ref_fps)


def test_default_sampling_is_two_fps(videos) -> None:
    sampling = plan_sampling(VideoSpec(videos.main), probe(VideoSpec(videos.main)))
    assert sampling.num_frames == 12 and sampling.sample_fps == 2.0  # 6 s at 2 fps
    assert sampling.second_per_grid_t == 1.0
    assert sampling.indices[0] == 0 and sampling.indices[-1] == 59
    # 84x56 is upscaled to at least 128 tokens of 28x28 pixels: scale sqrt(100352 / 4704),
    # each side rounded up to a multiple of 28.
    assert (sampling.resized_height, sampling.resized_width) == (280, 392)
    assert sampling.grid_thw == (6, 20, 28)


# ---------------------------------------------------------------------------------------------
# Frame parallelism.


@pytest.mark.parametrize("world_size", range(1, 9))
def test_patch_ranges_split_evenly(world_size: int) -> None:
    for total in [*range(world_size, world_size + 20), 100, 1001]:
        ranges = patch_ranges(total, world_size)
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), ranges
        sizes = [e - s for s, e in ranges]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1, sizes
        assert sizes == sorted(sizes, reverse=True), sizes  # earlier ranks get the extra ones
    for total in range(world_size):
        with pytest.raises(ValueError, match=f"{total} temporal patches.*{world_size} ranks"):
            patch_ranges(total, world_size)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_concatenate_to_whole_video(videos, backend: str) -> None:
    """Each rank decodes only its frames; in rank order they equal the single-process load."""
    spec = VideoSpec(videos.main, fps=5.0, backend=backend, **SMALL)
    whole = load_all_frames(spec)
    assert whole.sampling.num_patches == 15 and whole.frames.shape[0] == 30
    for world_size in range(1, 5):
        parts = [load_rank_frames(spec, rank, world_size) for rank in range(world_size)]
        for rank, part in enumerate(parts):
            assert part.sampling == whole.sampling
            assert part.patch_range == patch_ranges(15, world_size)[rank]
            assert part.frames.shape[0] == len(part.indices) == 2 * (
                part.patch_range[1] - part.patch_range[0])
        assert torch.equal(torch.cat([p.frames for p in parts]), whole.frames), world_size


@pytest.mark.parametrize("backend", BACKENDS)
def test_frame_chunks_are_the_rank_frames_in_whole_temporal_patches(
        videos, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """rank_frame_chunks decodes nothing until iterated; its chunks (even sizes, at most the
    asked frames) concatenate to the rank's frames; the decoder is closed at the end, and on
    close() without iterating; the preflight and the checks run before any decoding."""
    spec = VideoSpec(videos.main, fps=5.0, backend=backend, **SMALL)
    closed: list[int] = []
    reads: list[int] = []
    reader_cls = type(apbv.video.load._open(spec))
    real_close, real_read = reader_cls.close, reader_cls.read
    monkeypatch.setattr(reader_cls, "close", lambda self: closed.append(1) or real_close(self))
    monkeypatch.setattr(reader_cls, "read",
                        lambda self, idx: reads.append(len(idx)) or real_read(self, idx))
    sizes: list[tuple[int, int]] = []
    on_cpu = load_rank_frames(spec, 1, 2, device=torch.device("cpu"))  # the device path
    for per_chunk in (1, 2, 5, 100):
        whole = load_rank_frames(spec, 1, 2)
        assert torch.equal(whole.frames, on_cpu.frames)
        closed.clear(), reads.clear(), sizes.clear()
        sampling, patches, chunks = apbv.video.load.rank_frame_chunks(
            spec, 1, 2, frames_per_chunk=lambda h, w, n=per_chunk: sizes.append((h, w)) or n)
        assert (sampling, patches) == (whole.sampling, whole.patch_range) and not reads
        assert sizes == [(sampling.resized_height, sampling.resized_width)]
        got = list(chunks)
        want = max(2, per_chunk - per_chunk % 2)
        assert [len(c) for c in got[:-1]] == [want] * (len(got) - 1), [len(c) for c in got]
        assert all(len(c) % 2 == 0 for c in got)
        assert torch.equal(torch.cat(got), whole.frames), per_chunk
        assert closed == [1]
        with pytest.raises(RuntimeError, match="already read"):
            list(chunks)
    closed.clear()
    _, _, unread = apbv.video.load.rank_frame_chunks(spec, 0, 2, frames_per_chunk=lambda h, w: 4)
    unread.close()
    unread.close()
    assert closed == [1]
    closed.clear(), reads.clear()

    def refuse(sampling: object) -> None:
        raise ValueError("prompt too long")

    with pytest.raises(ValueError, match="prompt too long"):
        apbv.video.load.rank_frame_chunks(spec, 0, 2, frames_per_chunk=lambda h, w: 4,
                                          before_decode=refuse)
    assert closed == [1] and not reads


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoded_frames_are_the_sampled_ones(videos, backend: str) -> None:
    """Native-size frames (no resampling) match apbv.synthetic's frame of the sampled index."""
    spec = VideoSpec(videos.main, nframes=20, min_pixels=56 * 84, max_pixels=56 * 84,
                     backend=backend)
    got = load_rank_frames(spec, 2, 3)  # a middle share: the decoder has to seek
    assert (got.sampling.resized_height, got.sampling.resized_width) == (56, 84)
    truth = np.stack([make_frame(i, fps=10, width=84, height=56) for i in range(60)]).astype(float)
    for frame, index in zip(got.frames.permute(0, 2, 3, 1).numpy().astype(float), got.indices):
        errors = np.abs(truth - frame).mean(axis=(1, 2, 3))
        assert errors.argmin() == index and errors[index] < 4.0, (index, errors[index])


@pytest.mark.parametrize("name", ["main", "odd", "mkv"])
def test_decord_and_pyav_agree(videos, name: str) -> None:
    """Both decoders give the same metadata and bit-identical frames (measured: max diff 0 on
    libx264/mpeg4 yuv420p, sizes 84x56, 70x46, 64x48, mp4 and mkv); no tolerance is needed."""
    path = getattr(videos, name)
    metas = {b: probe(VideoSpec(path, backend=b)) for b in BACKENDS}
    assert metas["decord"] == metas["pyav"], metas
    frames = {b: load_all_frames(VideoSpec(path, fps=4.0, backend=b, **SMALL)).frames
              for b in BACKENDS}
    diff = (frames["decord"].int() - frames["pyav"].int()).abs()
    assert torch.equal(frames["decord"], frames["pyav"]), (
        f"decord vs pyav: max |diff| {diff.max()}, mean {diff.float().mean():.4f}")


def test_synthetic_video_is_deterministic(videos, tmp_path: Path) -> None:
    again = write_test_video(tmp_path / "again.mp4", num_frames=60, fps=10, width=84, height=56,
                             gop=6)
    a = load_all_frames(VideoSpec(videos.main, nframes=10, **SMALL)).frames
    b = load_all_frames(VideoSpec(again, nframes=10, **SMALL)).frames
    assert torch.equal(a, b)
    # One background colour per second; a different seed gives different colours.
    first, later = make_frame(0, fps=10, width=84, height=56), make_frame(10, fps=10, width=84,
                                                                           height=56)
    assert not np.array_equal(first[-1, -1], later[-1, -1])
    other = make_frame(0, fps=10, width=84, height=56, seed=1)
    assert not np.array_equal(first[-1, -1], other[-1, -1])


def test_the_writer_gives_the_same_bytes_after_decoding(tmp_path: Path) -> None:
    """What made the test above flaky (benchmarks/stress_decoders.py): with x264's mbtree on,
    a process that had decoded video wrote identical frames as other bytes in about 1 round
    of 3 (a pytest worker decodes before its second write); the decoders themselves returned
    the same frames every time."""
    from apbv.video.decoders import _PyAVReader

    kw = {"num_frames": 60, "fps": 10, "width": 84, "height": 56, "gop": 6}
    first = write_test_video(tmp_path / "first.mp4", **kw)
    want = first.read_bytes()
    for r in range(20):
        reader = _PyAVReader(str(first), str(first), needed=False, threads=4)
        assert reader.read(list(range(60))).shape == (60, 56, 84, 3)
        reader.close()
        got = write_test_video(tmp_path / f"again{r}.mp4", **kw).read_bytes()
        assert got == want, f"write {r + 1} after a decode: {len(got)} bytes, not {len(want)}"


# ---------------------------------------------------------------------------------------------
# Errors: the same ValueError on every rank, naming the file.


def _every_rank_raises(spec: VideoSpec, world_size: int, match: str) -> str:
    messages = set()
    for rank in range(world_size):
        with pytest.raises(ValueError, match=match) as err:
            load_rank_frames(spec, rank, world_size)
        messages.add(str(err.value))
    assert len(messages) == 1, messages
    message = messages.pop()
    assert spec.path in message, message
    return message


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_and_unreadable_files(videos, backend: str) -> None:
    missing = str(videos.dir / "missing.mp4")
    _every_rank_raises(VideoSpec(missing, backend=backend), 2, "does not exist")
    with pytest.raises(ValueError, match="not a regular file"):
        probe(VideoSpec(str(videos.dir), backend=backend))
    noise = videos.dir / f"noise_{backend}.mp4"
    noise.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, np.uint8).tobytes())
    _every_rank_raises(VideoSpec(noise, backend=backend), 2,
                       f"cannot be read by {backend} .*corrupt or truncated")


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncated_files(videos, backend: str) -> None:
    """Cut a real mp4: an index at the end (plain mp4) is lost, so the file cannot be opened;
    an index at the front (faststart) lists frames whose data is gone, and is reported as
    truncated. Never a partial or inconsistent load."""
    for name, fractions in (("main", [0.5]), ("faststart", [0.3, 0.5, 0.9, 0.98, 0.995])):
        data = getattr(videos, name).read_bytes()
        for fraction in fractions:
            cut = videos.dir / f"cut_{name}_{fraction}_{backend}.mp4"
            cut.write_bytes(data[: int(len(data) * fraction)])
            spec = VideoSpec(cut, backend=backend, **SMALL)
            message = _every_rank_raises(spec, 2, "truncated")
            with pytest.raises(ValueError, match="truncated"):
                probe(spec)
            assert "corrupt" in message


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_frame_file(videos, backend: str) -> None:
    path = write_test_video(videos.dir / f"empty_{backend}.mp4", num_frames=0, fps=10, width=64,
                            height=48)
    # PyAV sees the empty video track; decord refuses to open it (its message is not specific).
    match = "has no video frames" if backend == "pyav" else "cannot be read by decord"
    _every_rank_raises(VideoSpec(path, backend=backend), 2, match)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unfollowed_path_opens_the_checked_file_or_nothing(videos, backend: str) -> None:
    """follow_symlinks=False (the server's clients): a link anywhere on the path is refused by
    name on every rank, a FIFO is refused without blocking, and the decoder reads the file the
    path named when it was opened, whatever the path is swapped for afterwards."""
    root = Path(os.path.realpath(videos.dir)) / f"nofollow_{backend}"
    (root / "real").mkdir(parents=True)
    clip = write_test_video(root / "real" / "clip.mp4", num_frames=8, fps=4, width=56,
                            height=56)
    os.symlink(root / "real", root / "linked")
    os.symlink(clip, root / "real" / "link.mp4")
    os.mkfifo(root / "real" / "fifo.mp4")

    def spec(path: Path, follow: bool = False) -> VideoSpec:
        return VideoSpec(path, backend=backend, follow_symlinks=follow, **SMALL)

    expected = load_rank_frames(spec(clip, follow=True), 0, 1).frames
    assert torch.equal(load_rank_frames(spec(clip), 0, 1).frames, expected)
    assert probe(spec(root / "linked" / "clip.mp4", follow=True)).total_frames == 8
    message = _every_rank_raises(spec(root / "linked" / "clip.mp4"), 2, "not followed")
    assert f"{str(root / 'linked')!r} on its path is a symbolic link" in message, message
    _every_rank_raises(spec(root / "real" / "link.mp4"), 2, "it is a symbolic link")
    _every_rank_raises(spec(root / "real" / "fifo.mp4"), 2, "not a regular file")
    _every_rank_raises(spec(root / "real" / ".." / "real" / "clip.mp4"), 1, "holds '..'")

    def native(path: Path, follow: bool, swap_in: Path | None = None) -> torch.Tensor:
        reader = apbv.video.load._open(spec(path, follow))
        try:
            if swap_in is not None:
                os.replace(swap_in, path)
            return reader.read(list(range(8)))
        finally:
            reader.close()

    other = write_test_video(root / "other.mp4", num_frames=8, fps=4, width=56, height=56,
                             seed=5)
    before, after = native(clip, True), native(other, True)
    assert not torch.equal(before, after)
    assert torch.equal(native(clip, False, swap_in=other), before), \
        "the decoder read the file swapped in after the open"


def test_too_few_patches_for_ranks(videos) -> None:
    spec = VideoSpec(videos.main, nframes=4, **SMALL)  # 2 temporal patches
    message = _every_rank_raises(spec, 3, "2 temporal patches .* 3 ranks")
    assert "at most 2 ranks" in message and "fps" in message and "nframes" in message
    assert load_rank_frames(spec, 1, 2).frames.shape[0] == 2  # 2 ranks are fine


def test_too_short_video_or_range(videos) -> None:
    one = write_test_video(videos.dir / "one.mp4", num_frames=1, fps=10, width=64, height=48)
    _every_rank_raises(VideoSpec(one), 1, "cannot sample frames from 1 frames")
    # A start past the end of the 6 s video leaves no frames to sample.
    _every_rank_raises(VideoSpec(videos.main, video_start=7.0), 2, "Invalid time range")


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="backend must be one of decord, pyav, nvdec; got 'torch"):
        VideoSpec("x.mp4", backend="torchcodec")
    with pytest.raises(ValueError, match="fps and nframes are exclusive"):
        VideoSpec("x.mp4", fps=2.0, nframes=8)
    bad = [
        ({"fps": 0.0}, "fps must be > 0, got 0.0"),
        ({"nframes": 1}, "nframes must be an integer >= 2, got 1"),
        ({"nframes": 8.0}, "nframes must be an integer"),
        ({"min_frames": 8, "max_frames": 4}, "max_frames"),
        ({"min_pixels": 1000, "max_pixels": 999}, "max_pixels"),
        ({"video_start": 3.0, "video_end": 2.0}, "video_end"),
        ({"total_pixels": -1}, "total_pixels"),
        ({"image_patch_size": 0}, "image_patch_size"),
    ]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            VideoSpec("x.mp4", **kwargs)
    assert VideoSpec(Path("a") / "b.mp4").path == str(Path("a") / "b.mp4")


@pytest.mark.parametrize("module", ["decord", "av", "qwen_vl_utils.vision_process"])
def test_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch, videos,
                                         module: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    backend = "pyav" if module == "av" else "decord"
    with pytest.raises(ImportError, match=r"apbv\[video\]"):
        load_all_frames(VideoSpec(videos.main, backend=backend))


def test_import_without_video_extra() -> None:
    code = (
        "import sys\n"
        "for m in ('decord', 'av', 'qwen_vl_utils', 'torchvision'): sys.modules[m] = None\n"
        "import apbv, apbv.plan, apbv.video, apbv.synthetic.videos\n"
        "print(apbv.plan.patch_ranges(5, 2)[1])\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "(3, 5)", out.stderr[-2000:]
