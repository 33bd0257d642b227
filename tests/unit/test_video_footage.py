"""Camera-like footage (apbv.video.footage) and decoding only what sampling needs.

Tiny files (2-3 s, 160x96): H.264 with and without B-frames, a variable-frame-rate file and
H.265 where PyAV's FFmpeg has libx265. The ``needed`` PyAV reader must give the frames of the
earlier reader (``decode="all"``) bit for bit while decoding fewer frames.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("av")
pytest.importorskip("decord")
pytest.importorskip("qwen_vl_utils")

import av

from apbv.config import VideoConfig
from apbv.video import VideoSpec, load_rank_frames, probe
from apbv.video.decoders import _open
from apbv.video.footage import write_camera_video

SMALL = {"min_pixels": 4 * 28 * 28, "max_pixels": 16 * 28 * 28}
CAMERA = {"fps": 30, "width": 160, "height": 96, "gop_seconds": 1.0}


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    d = tmp_path_factory.mktemp("footage")
    files = {
        "bframes": write_camera_video(d / "b.mp4", seconds=3, bframes=3, **CAMERA),
        "pframes": write_camera_video(d / "p.mp4", seconds=2, bframes=0, **CAMERA),
        "vfr": write_camera_video(d / "vfr.mp4", seconds=3, bframes=2, vfr=True, **CAMERA),
    }
    if "libx265" in av.codecs_available:
        files["h265"] = write_camera_video(d / "h265.mp4", seconds=2, bframes=2, codec="h265",
                                           **CAMERA)
    return SimpleNamespace(dir=d, **files)


def _packets(path) -> list:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        return [p for p in container.demux(stream) if p.size]


def test_camera_footage_has_the_asked_structure(clips) -> None:
    reader = _open(VideoSpec(clips.bframes, backend="pyav"))
    try:
        assert reader.meta.total_frames == 90 and reader.meta.fps == 30
        assert reader.keyframes == (0, 30, 60)  # exactly every gop_seconds
    finally:
        reader.close()
    decode_order = [p.pts for p in _packets(clips.bframes)]
    assert decode_order != sorted(decode_order)  # B-frames: reordered
    plain = [p.pts for p in _packets(clips.pframes)]
    assert plain == sorted(plain)  # no B-frames
    vfr = sorted(p.pts for p in _packets(clips.vfr))
    steps = {b - a for a, b in zip(vfr, vfr[1:])}
    assert len(steps) == 2, steps  # one and two frame intervals


def test_camera_footage_rejects_bad_settings(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"codec must be one of \('h264', 'h265'\)"):
        write_camera_video(tmp_path / "x.mp4", seconds=1, codec="vp9")
    with pytest.raises(ValueError, match="width must be even"):
        write_camera_video(tmp_path / "x.mp4", seconds=1, width=161, height=96)
    with pytest.raises(ValueError, match="bframes must be in 0..16"):
        write_camera_video(tmp_path / "x.mp4", seconds=1, width=160, height=96, bframes=17)
    assert not (tmp_path / "x.mp4").exists()


@pytest.mark.parametrize("name", ["bframes", "pframes", "vfr", "h265"])
def test_needed_decode_gives_the_same_frames(clips, name: str) -> None:
    """Every rank's sampled frames equal the earlier reader's bit for bit (2 and 3 ranks,
    sparse and dense sampling); decord (H.264) gives the same pixels too."""
    path = getattr(clips, name, None)
    if path is None:
        pytest.skip("libx265 is not in PyAV's FFmpeg build")
    def frames(nframes: int, world: int, **kw) -> torch.Tensor:
        spec = VideoSpec(path, nframes=nframes, **SMALL, **kw)
        return torch.cat([load_rank_frames(spec, r, world).frames for r in range(world)])

    for nframes, world in ((8, 2), (24, 3)):
        before = frames(nframes, world, backend="pyav", decode="all")
        assert torch.equal(frames(nframes, world, backend="pyav", decode="needed",
                                  decode_threads=2), before)
        if name != "h265":  # decord 0.6 misorders some H.265 B-frames: not compared
            assert torch.equal(frames(nframes, world, backend="decord", decode_threads=1),
                               before)


def test_needed_decode_does_less_work(clips) -> None:
    """No frame decoded at open (the packet index answers the truncation check); with
    B-frames, the frames nothing refers to are skipped unless sampled."""
    work = {}
    for decode in ("all", "needed"):
        reader = _open(VideoSpec(clips.bframes, backend="pyav", decode=decode))
        try:
            at_open = reader.frames_decoded
            indices = list(range(0, 90, 15))  # 2 fps of 30 fps
            reader.expect(indices)
            reader.read(indices)
            work[decode] = (at_open, reader.frames_decoded - at_open)
        finally:
            reader.close()
    assert work["needed"][0] == 0 and work["all"][0] > 0, work
    assert work["needed"][1] < 0.7 * work["all"][1], work


def test_truncated_camera_file_fails_at_open(clips) -> None:
    """A cut file fails when it is opened (before any rank decodes its frames), whichever
    decode mode: the index lists frames whose packets are missing or incomplete."""
    cut = clips.dir / "cut.mp4"  # the index moved to the front: the cut file still opens
    with av.open(str(clips.bframes)) as src, av.open(str(cut), "w",
                                                      options={"movflags": "faststart"}) as dst:
        stream = dst.add_stream_from_template(src.streams.video[0])
        for packet in src.demux(src.streams.video[0]):
            if packet.size:
                packet.stream = stream
                dst.mux(packet)
    whole = cut.read_bytes()
    cut.write_bytes(whole[: int(len(whole) * 0.97)])
    for decode in ("needed", "all"):
        with pytest.raises(ValueError, match="truncated"):
            probe(VideoSpec(cut, backend="pyav", decode=decode))


def test_decode_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="decode must be one of needed, all; got 'some'"):
        VideoSpec("x.mp4", decode="some")
    with pytest.raises(ValueError, match="decode_threads must be an integer >= 1, got 0"):
        VideoSpec("x.mp4", decode_threads=0)
    with pytest.raises(ValueError, match="video.decode must be one of"):
        VideoConfig(decode="fast")
    spec = VideoConfig(decode="all", decode_threads=2).spec("x.mp4")
    assert (spec.decode, spec.decode_threads) == ("all", 2)


def test_plan_video_prints_decode_work_per_rank(clips, capsys) -> None:
    from apbv.__main__ import main

    assert main(["plan", "--video", str(clips.pframes), "--world-size", "2",
                 "--hardware", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "60 frames at 30 fps (2.0 s), 160x96, 2 keyframes" in out, out
    # 2 fps of 60 frames at 30 fps: 4 sampled frames, 2 per rank, in separate intervals.
    assert "rank 0: 2 sampled frames" in out and "rank 1: 2 sampled frames" in out, out
    assert out.count("predicted frame work") == 4, out


def test_snap_to_keyframes_samples_keyframes_and_says_which_moved(clips) -> None:
    """At 2 fps of 30 fps with a keyframe every second, a tolerance of 0.5 s moves every
    sample but the last (frame 89, 1 s after a keyframe) onto a keyframe: far fewer frames
    decoded, and the moves are listed; without the keyframe index (a VideoMeta built by
    hand) it is refused by name."""
    from apbv.video import VideoMeta, plan_sampling

    exact = VideoSpec(clips.bframes, fps=2.0, backend="pyav", **SMALL)
    snapped = VideoSpec(clips.bframes, fps=2.0, backend="pyav", snap_to_keyframes=0.5, **SMALL)
    meta = probe(exact)
    assert meta.keyframes == (0, 30, 60)
    before, after = plan_sampling(exact, meta), plan_sampling(snapped, meta)
    assert before.moved == () and len(after.indices) == len(before.indices)
    assert set(after.indices) == {0, 30, 60, 89}
    assert after.moved and all(before.indices[p] == i for p, i, _ in after.moved)
    work = []
    for spec in (exact, snapped):
        reader = _open(spec)
        try:
            reader.read(plan_sampling(spec, reader.meta).indices)
            work.append(reader.frames_decoded)
        finally:
            reader.close()
    assert work[1] < work[0] / 2, work
    with pytest.raises(ValueError, match="snap_to_keyframes needs the file's keyframe index"):
        plan_sampling(snapped, VideoMeta(90, 30.0, 96, 160))
    with pytest.raises(ValueError, match="video.snap_to_keyframes must be a number"):
        VideoConfig(snap_to_keyframes="1s")


def test_nvdec_is_refused_by_name_where_it_cannot_run(clips) -> None:
    """backend='nvdec' is accepted as a setting; opening a file without torchcodec's CUDA
    decoder (or without a GPU) fails naming what is missing and the host decoders."""
    try:
        import torchcodec  # noqa: F401
        if torch.cuda.is_available():
            pytest.skip("torchcodec and a GPU are here: the GPU check covers nvdec")
    except Exception:
        pass
    assert VideoConfig(backend="nvdec").spec("x.mp4").backend == "nvdec"
    with pytest.raises(ValueError, match=r"backend='nvdec' needs .*decord, pyav"):
        probe(VideoSpec(clips.pframes, backend="nvdec"))
    with pytest.raises(ValueError, match="backend must be one of decord, pyav, nvdec; got 'gpu'"):
        VideoSpec("x.mp4", backend="gpu")
