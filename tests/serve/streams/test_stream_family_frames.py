"""The server sizes a live stream's frames and reserves its KV by the served family's rule
(StreamOptions.sizing, from the checkpoint's config), without ranks: a Qwen3-VL server's
streams take frames of multiples of 32 (the open's width / height, a first push's native
size, a source's capture) where a Qwen2.5-VL server's keep multiples of 28, and
``keep_vision`` reserves the kept tower rows with their DeepStack levels."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("fastapi")

from apbv import cost  # noqa: E402
from apbv.capture import UrlSource  # noqa: E402
from apbv.serve.streams.budget import KVSizing  # noqa: E402
from apbv.serve.streams.registry import start_capture  # noqa: E402
from apbv.synthetic.videos import write_test_video  # noqa: E402
from tests.serve.streams.test_stream_bookkeeping import _streams  # noqa: E402


def _sizing(preset: str) -> KVSizing:
    return KVSizing.of_dims(cost.preset_dims(preset), 32768, 2, world_size=1,
                            max_frames_per_push=4)


@pytest.mark.parametrize("preset, opened, pushed", [
    ("qwen2.5-vl-7b", (476, 644), (280, 392)),  # as before: multiples of 28
    ("qwen3-vl-8b", (480, 640), (320, 448)),  # multiples of 32: the engine takes them
])
def test_open_and_first_push_size_frames_by_the_served_family(preset, opened, pushed):
    streams, _ = _streams(sizing=_sizing(preset))
    spec, sized, pixels, native = streams._spec({"width": 640, "height": 480})
    assert (spec.height, spec.width, sized, native) == (*opened, True, (480, 640))
    multiple = streams.opt.family.frame_multiple
    unsized, sized, pixels, _ = streams._spec({})
    assert (unsized.height, unsized.width, sized) == (multiple, multiple, False)
    assert streams.registry.size_of(pixels, (48, 64)) == pushed
    assert all(side % multiple == 0 for side in opened + pushed)


def test_keep_vision_reserves_more_for_deepstack_rows():
    sizing = _sizing("qwen3-vl-8b")
    streams, _ = _streams(sizing=sizing)
    body = {"width": 640, "height": 480, "window_s": 4}
    plain = streams.registry.need(streams._spec(body)[0], True, None)
    kept = streams.registry.need(streams._spec({**body, "keep_vision": True})[0], True, None)
    tokens = sizing.tokens_per_rank(480 * 640 // 1024, 2.0, 4.0, None)
    assert plain == sizing.kv_bytes_per_token * tokens
    assert kept - plain == 4096 * 4 * 2 * tokens  # hidden x (1 + 3 DeepStack levels) x bf16


def test_a_sources_capture_resizes_by_the_families_patch(tmp_path):
    path = write_test_video(tmp_path / "clip.mp4", num_frames=2, fps=4.0, width=64, height=48)
    spec, sized, pixels, _ = _streams(sizing=_sizing("qwen3-vl-8b"))[0]._spec(
        {"max_pixels": 56 * 56})
    for patch, size in ((14, (56, 56)), (16, (32, 64))):  # 28- and 32-pixel multiples
        capture = start_capture(UrlSource(str(path)), spec, sized, pixels, patch)
        try:
            deadline = time.monotonic() + 15
            frames = []
            while not frames:
                assert time.monotonic() < deadline, capture.stats()
                frames = capture.take(1, timeout=1.0)
            assert tuple(frames[0].image.shape) == (3, *size)
        finally:
            capture.close()
