"""The server's host memory budget without a server: the default budget from the machine's
figures, what a request needs by its native frame size, admission refusing 503 (never fits)
and 429 (not now) with the figures, each replica's largest job counted once; and the native
frame size read from the container's header without decoding a frame."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from apbv import cost
from apbv.cost.memory import DECODE_CHUNK_ELEMENTS, NATIVE_CHUNK_BYTES, NATIVE_FRAME_BYTES
from apbv.openai.policy import ClientError
from apbv.plan import make_plan
from apbv.serve.scheduler import memory_budget as mb
from apbv.serve.scheduler.admission import Admission
from apbv.video import VideoSpec
from apbv.video.header import check_native_size, header_size
from tests.native_video import write_large_frame_video

GIB = 1 << 30


def test_the_default_budget_stays_below_rays_line() -> None:
    budget, why = mb.default_budget_bytes(total=32 * GIB, available=28 * GIB, to_load=2 * GIB,
                                          kill_fraction=0.95)
    # 85% of 32 GiB = 27.2 GiB, less 4 GiB used and 2 GiB to load
    assert budget == int(32 * GIB * 0.85) - 6 * GIB, budget / GIB
    assert "21.20 GiB" in why and "Ray kills a rank at 95%" in why, why
    with pytest.raises(ValueError, match="no host memory is left.*--host-memory-budget-gb"):
        mb.default_budget_bytes(total=32 * GIB, available=4 * GIB, to_load=0)
    assert mb.ray_kill_fraction({"RAY_memory_usage_threshold": "0.8"}) == 0.8
    for bad in ("x", "0", "1.5"):
        assert mb.ray_kill_fraction({"RAY_memory_usage_threshold": bad}) == 0.95, bad
    assert mb.ray_kill_fraction({}) == 0.95


def test_downloads_count_only_on_a_memory_filesystem(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n"
                      "tmpfs /run/my\\040dir tmpfs rw 0 0\n")
    assert mb.on_tmpfs("/dev/shm/apbv-media-x", str(mounts))
    assert mb.on_tmpfs("/run/my dir/x", str(mounts))
    assert not mb.on_tmpfs("/var/tmp/apbv-media-x", str(mounts))
    assert not mb.on_tmpfs("/dev/shmx/y", str(mounts))  # a prefix, not a parent
    assert not mb.on_tmpfs("/x", str(tmp_path / "missing"))


def _measured(native: tuple[int, int], frames: int = 16) -> dict[str, int]:
    return {"frames": frames, "height": 448, "width": 448, "context_len": 2000,
            "query_len": 20, "source_pixels": native[0] * native[1]}


def test_a_requests_need_follows_its_native_frames() -> None:
    dims = cost.preset_dims("qwen2.5-vl-7b")

    def need(native: tuple[int, int], on_gpu: bool = False, frames: int = 16,
             mode: str = "spava") -> int:
        return mb.request_host_bytes(dims, _measured(native, frames), mode=mode,
                                     world_size=2, dtype_bytes=2, max_tokens=16,
                                     on_gpu=on_gpu)

    small, k8 = need((448, 448)), need((8192, 8192))
    # An 8192x8192 frame is decoded alone (201M values > one chunk), on each of the 2 ranks.
    assert 3 * 8192**2 > DECODE_CHUNK_ELEMENTS
    per_frame = NATIVE_FRAME_BYTES + NATIVE_CHUNK_BYTES
    assert k8 >= 2 * per_frame * 8192**2 and k8 > 6 * small, \
        (small / GIB, k8 / GIB)
    assert need((2160, 3840)) < need((4320, 7680)) < k8
    # No weights, no engine memory: a request of 16 small frames stays far below the 15 GiB
    # of the 7B model's bf16 weights; on GPU ranks only the host parts count.
    assert small < GIB and need((448, 448), on_gpu=True) < small
    assert need((8192, 8192), on_gpu=True) >= 2 * per_frame * 8192**2
    # Every rank encodes the whole video without the vision split; one process for "full".
    assert need((1080, 1920), mode="no_vit_split") > need((1080, 1920))
    assert 0 < need((1080, 1920), mode="full") < need((1080, 1920))


def test_the_decoding_chunk_is_counted_at_the_native_size() -> None:
    dims = cost.preset_dims("qwen2.5-vl-7b")
    plan = make_plan(2000, 20, 1)

    def decode(native: int, patches: int = 8) -> int:
        return cost.request_memory(dims, plan, patches=patches, grid_hw=(16, 16), dtype_bytes=2,
                                   reserve_tokens=0, rank=0, native_pixels=native).parts["decode"]

    resized = decode(0)  # 16 frames of 224x224: 6 copies of the 2.4M values
    assert resized == 6 * 16 * 224 * 224 * 3
    def native(pixels: int, chunk: int) -> int:
        return int(pixels * (NATIVE_FRAME_BYTES + NATIVE_CHUNK_BYTES * chunk))

    assert decode(8192**2) == native(8192**2, 1)  # one frame a chunk
    assert decode(1920 * 1080) == native(1920 * 1080, 5)  # 5 a chunk of 32 Mi values
    assert decode(1920 * 1080, patches=1) == native(1920 * 1080, 2)  # all it decodes
    assert decode(112 * 112) == resized  # smaller than the resized frames' copies


def _call(need: int) -> SimpleNamespace:
    return SimpleNamespace(deadline_ms=None, request=None, need=need)


def _budget(budget_gb: float) -> mb.MemoryBudget:
    return mb.MemoryBudget(int(budget_gb * GIB), sizer=lambda call, measured: call.need)


def test_admission_refuses_what_the_budget_cannot_hold_with_the_figures() -> None:
    async def scenario() -> None:
        memory = _budget(4.0)
        first, second = Admission(8, memory=memory), Admission(8, memory=memory)
        with pytest.raises(ClientError) as err:
            first.admit(_call(5 * GIB), {"frames": 1})
        assert err.value.status == 503, err.value.message
        for text in ("needs 5.000 GiB", "0.000 GiB are in flight (nothing)",
                     "budget is 4.000 GiB (--host-memory-budget-gb)"):
            assert text in err.value.message, err.value.message
        big = first.admit(_call(3 * GIB), {})
        assert big.host_bytes == 3 * GIB
        # The same replica runs one job at a time: a smaller one waits within its largest.
        assert first.admit(_call(2 * GIB), {}).host_bytes == 2 * GIB
        assert memory.held() == {"requests": 3 * GIB}
        # Another replica's job would hold memory at the same time: 3 + 2 > 4 GiB, not now.
        with pytest.raises(ClientError) as err:
            second.admit(_call(2 * GIB), {})
        assert err.value.status == 429, err.value.message
        assert "needs 2.000 GiB" in err.value.message
        assert "3.000 GiB are in flight (requests 3.000)" in err.value.message
        second.admit(_call(GIB), {})  # 3 + 1 fits
        # Once the big job is done (and the other dropped), the room is back.
        assert await first.next() is big
        first.done(big)
        assert first.drop(first.waiting()[0])
        assert memory.held() == {"requests": GIB}
        second.admit(_call(3 * GIB), {})
        # A kept part (the vision cache) that leaves too little is a 503, a passing one a 429.
        memory.parts["vision cache"] = lambda: GIB
        memory.parts["streams"] = lambda: GIB // 2
        with pytest.raises(ClientError) as err:
            first.admit(_call(int(3.5 * GIB)), {})
        assert err.value.status == 503 and "vision cache 1.000" in err.value.message
        with pytest.raises(ClientError) as err:
            first.admit(_call(2 * GIB), {})
        assert err.value.status == 429 and "streams 0.500" in err.value.message
        # A live stream's operation is its stream's, never sized here.
        op = first.admit(None, {}, op=SimpleNamespace(), predicted_s=0.0, stream_id="s")
        assert op.host_bytes == 0

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def video_8k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_large_frame_video(tmp_path_factory.mktemp("big") / "8k.mp4", 8192, 8192)


def _growth_mb(fn: Callable[[], object]) -> int:
    """MB by which ``fn()`` raises this process's peak resident memory (VmHWM, reset first)."""
    def peak() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) // 1024

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = peak()
    fn()
    return peak() - before


def test_the_native_size_comes_from_the_header_without_decoding(video_8k: Path) -> None:
    assert header_size(VideoSpec(str(video_8k))) == (8192, 8192)
    with pytest.raises(ValueError) as err:
        check_native_size(VideoSpec(str(video_8k)), 4096 * 2160, "--max-native-pixels")
    assert ("native frame size is 8192x8192 (67108864 pixels), over the limit of 8847360 "
            "pixels (--max-native-pixels)") in str(err.value)
    assert check_native_size(VideoSpec(str(video_8k)), 8192**2, "x") == (8192, 8192)
    # The process's peak memory reset before each (clear_refs): reading the header raises it
    # by a few MB, where opening the file with a decoder decodes a frame (100 MB of yuv420p at
    # this size; 64 MB of it was seen touched in a loaded worker, 150 MB alone).
    decord = pytest.importorskip("decord")
    header_mb = _growth_mb(lambda: header_size(VideoSpec(str(video_8k))))
    decoder_mb = _growth_mb(lambda: decord.VideoReader(str(video_8k), num_threads=1))
    assert header_mb < 20 and decoder_mb > 40, (header_mb, decoder_mb)


def test_a_file_without_a_readable_header_is_left_to_the_decoders_checks(
        tmp_path: Path) -> None:
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"not a video" * 100)
    assert header_size(VideoSpec(str(junk))) is None
    assert header_size(VideoSpec(str(tmp_path / "missing.mp4"))) is None
    link = tmp_path / "link.mp4"
    link.symlink_to(junk)
    assert header_size(VideoSpec(str(link), follow_symlinks=False)) is None


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_serve_refuses_a_budget_that_is_not_positive_before_ray_starts(monkeypatch, value):
    import argparse

    ray = pytest.importorskip("ray")
    from apbv.config import load_config
    from apbv.serve import main

    p = argparse.ArgumentParser()
    main.add_serve_args(p)
    args = p.parse_args(["--host-memory-budget-gb", value])
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    with pytest.raises(ValueError, match=f"--host-memory-budget-gb must be > 0, got {value}"):
        main.run_server(load_config("tiny_cpu"), args)


def test_check_request_refuses_large_native_frames_for_the_server_and_batch(
        tiny_model_dir: Path, video_8k: Path, short_video: Path) -> None:
    """:func:`apbv.openai.chat.check_request`, which the server and ``apbv batch`` run on every
    request before the ranks: a 400 naming the size and the limit, the default limit or one
    set lower; a video within it is measured as before."""
    from transformers import AutoProcessor

    from apbv.config import load_config
    from apbv.engine.request import Request
    from apbv.openai.chat import check_request
    from apbv.openai.policy import Limits

    cfg = load_config("tiny_cpu", [f"model.path={str(tiny_model_dir)!r}"])
    processor = AutoProcessor.from_pretrained(tiny_model_dir, local_files_only=True)
    with pytest.raises(ClientError) as err:
        check_request(Request.from_config(cfg, str(video_8k), "Which colour?"), Limits(),
                      processor)
    assert err.value.status == 400 and "8192x8192" in err.value.message
    assert "over the limit of 8847360 pixels (--max-native-pixels)" in err.value.message
    small = Request.from_config(cfg, str(short_video), "Which colour?")
    assert check_request(small, Limits(), processor)["source_pixels"] == 112 * 112
    with pytest.raises(ClientError, match="112x112 .12544 pixels., over the limit of 12543"):
        check_request(small, Limits(max_native_pixels=112 * 112 - 1), processor)
