"""The fast CPU resize (apbv.video.bicubic): torch's interpolated values, every bit, on frames
of every shape the runtime resizes, and torch's kernel wherever it cannot show that."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

pytest.importorskip("torchvision")
pytest.importorskip("numba")

from apbv.video import bicubic, load

SIZES = [
    ((1080, 1920), (84, 140)),   # camera footage under the benchmark's pixel budget
    ((720, 1280), (364, 644)),   # a milder downscale
    ((1080, 1920), (1080, 140)),  # the width only
    ((1080, 1920), (84, 1920)),  # the height only
    ((300, 400), (616, 812)),    # an upscale
    ((333, 517), (140, 196)),    # odd sizes, rows not a multiple of the kernel's 16
    ((240, 320), (112, 140)),    # window bounds that are whole numbers (torch's float32 rule)
]


def _frames(source: tuple[int, int], seed: int) -> torch.Tensor:
    """Two frames, uint8 (2, H, W, 3): random pixels, and smooth gradients with sharp edges
    (values near every rounding boundary, and long runs of one value)."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (*source, 3), dtype=torch.uint8, generator=gen)
    ys, xs = torch.meshgrid(torch.arange(source[0]), torch.arange(source[1]), indexing="ij")
    smooth = torch.stack([(xs * 255) // source[1], (ys * 255) // source[0],
                          ((xs // 37 + ys // 23) % 2) * 255], dim=-1).to(torch.uint8)
    return torch.stack([noise, smooth])


@pytest.mark.parametrize("source, size", SIZES)
def test_fast_resize_equals_torch(source: tuple[int, int], size: tuple[int, int]) -> None:
    """Frames other than the plan's own check frame get resize_frames' bytes, and the values
    before the cast are torch's float32 values bit for bit."""
    plan = bicubic.fast_plan(source, size)
    assert plan is not None, (f"no summation order reproduces torch's kernel for {source} -> "
                              f"{size} (CPU capability {torch.backends.cpu.get_cpu_capability()})")
    frames = _frames(source, seed=11)
    expected = load.resize_frames(frames.permute(0, 3, 1, 2), size, fast=False)
    out = torch.empty((2, 3, *size), dtype=torch.uint8)
    resize = bicubic.frame_resizer(source, size)
    for k in range(2):
        resize(frames[k], out[k])
    assert torch.equal(out, expected), f"{int((out != expected).sum())} bytes differ"
    import torchvision.transforms.functional as F

    values = F.resize(frames.permute(0, 3, 1, 2).float(), list(size),
                      interpolation=F.InterpolationMode.BICUBIC, antialias=True)
    rows = plan.float_resizer()
    for k in range(2):
        got = torch.from_numpy(rows(frames[k]).copy()).reshape(*size, 3).permute(2, 0, 1)
        differ = int((got != values[k]).sum())
        assert differ == 0, f"{differ} float32 values differ (max {(got - values[k]).abs().max()})"


def test_a_wrong_order_is_refused_and_torch_resizes(monkeypatch, caplog) -> None:
    """With only an order torch does not use on offer (every tap added on its own, where this
    CPU's kernel fuses the last ones, or fused everywhere where it does not), no plan is made,
    the reason is logged, and frame_resizer falls back to torch's kernel with its bytes."""
    source, size = (720, 1280), (364, 644)
    right = bicubic.fast_plan(source, size)
    assert right is not None
    wrong = 0 if right.group == 1 else 1
    bicubic.fast_plan.cache_clear()
    monkeypatch.setattr(bicubic, "GROUPINGS", (wrong,))
    try:
        with caplog.at_level(logging.INFO, logger="apbv.video.bicubic"):
            assert bicubic.fast_plan(source, size) is None
        assert "no summation order" in caplog.text
        frames = _frames(source, seed=5)
        out = torch.empty((2, 3, *size), dtype=torch.uint8)
        resize = bicubic.frame_resizer(source, size)
        for k in range(2):
            resize(frames[k], out[k])
        assert torch.equal(out, load.resize_frames(frames.permute(0, 3, 1, 2), size, fast=False))
    finally:
        bicubic.fast_plan.cache_clear()


def test_the_wrong_order_would_change_values() -> None:
    """The check can fail: the other order's float32 values differ from torch's in many places
    (so a plan's acceptance says something)."""
    source, size = (720, 1280), (364, 644)
    right = bicubic.fast_plan(source, size)
    assert right is not None
    wrong = bicubic.FastPlan(source, size, right.across, right.down,
                             0 if right.group == 1 else 1)
    frame = _frames(source, seed=3)[0]
    differ = int((right.float_resizer()(frame) != wrong.float_resizer()(frame)).sum())
    assert differ > 100, f"only {differ} values differ between the two orders"


def test_small_frames_keep_torch_kernel(monkeypatch) -> None:
    """Under FAST_MIN_VALUES no plan is asked for (its check would cost more than it saves)."""
    def no_plan(*_):  # noqa: ANN002, ANN202
        raise AssertionError("fast_plan was called for a small frame")

    monkeypatch.setattr(bicubic, "fast_plan", no_plan)
    frames = _frames((108, 192), seed=2)
    out = torch.empty((2, 3, 56, 84), dtype=torch.uint8)
    resize = bicubic.frame_resizer((108, 192), (56, 84))
    for k in range(2):
        resize(frames[k], out[k])
    assert torch.equal(out, load.resize_frames(frames.permute(0, 3, 1, 2), (56, 84), fast=False))


def test_resizers_do_not_share_buffers() -> None:
    """Two readers of one size (two threads) each get their own scratch buffers."""
    source, size = (720, 1280), (364, 644)
    plan = bicubic.fast_plan(source, size)
    assert plan is not None
    one, two = plan.float_resizer(), plan.float_resizer()
    frames = _frames(source, seed=9)
    first = one(frames[0])
    second = two(frames[1])
    assert not np.shares_memory(first, second)
    assert not np.array_equal(first, second)


@pytest.mark.parametrize("backend", ["pyav", "decord"])
def test_decoded_footage_through_the_fast_kernel(backend: str, tmp_path, monkeypatch) -> None:
    """Camera footage with B-frames, decoded with video.decode=needed (each frame resized by the
    fast kernel as decoded) and decode=all (chunks of stacked frames through torch's kernel):
    the same frames, bit for bit, on both decoders, and the fast kernel did run."""
    pytest.importorskip("av")  # writes the footage, and is the pyav backend
    pytest.importorskip("decord")
    from apbv.video import VideoSpec, load_rank_frames
    from apbv.video.footage import write_camera_video

    path = write_camera_video(tmp_path / "c.mp4", seconds=1, fps=30, width=320, height=240,
                              gop_seconds=0.5, bframes=2)
    made: list[bicubic.FastPlan] = []
    original = bicubic.FastPlan.resizer

    def resizer(self):  # noqa: ANN001, ANN202
        made.append(self)
        return original(self)

    monkeypatch.setattr(bicubic.FastPlan, "resizer", resizer)
    frames = {}
    for decode in ("needed", "all"):
        spec = VideoSpec(path, nframes=8, backend=backend, decode=decode,
                         min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28)
        frames[decode] = load_rank_frames(spec, 0, 1).frames
    assert [p.source for p in made] == [(240, 320)], made
    assert torch.equal(frames["needed"], frames["all"])


@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_resize_frames_uses_the_fast_kernel_with_torch_bytes(layout: str, monkeypatch) -> None:
    """resize_frames (the server's decoded frames, the capture loop, pushed stream frames) on
    large CPU frames: the fast kernel, once per call, with torch's bytes in either memory
    layout; fast=False (video.decode=all, the earlier path) and small frames never ask."""
    source, size = (360, 640), (196, 336)
    frames = torch.cat([_frames(source, seed=4), _frames(source, seed=8)]).permute(0, 3, 1, 2)
    if layout == "contiguous":
        frames = frames.contiguous()
    expected = load.resize_frames(frames, size, fast=False)
    asked: list[tuple] = []
    original = bicubic.frame_resizer

    def counting(*args):  # noqa: ANN002, ANN202
        asked.append(args)
        return original(*args)

    monkeypatch.setattr(load, "frame_resizer", counting)
    got = load.resize_frames(frames, size)
    assert asked == [(source, size)] and torch.equal(got, expected)
    load.resize_frames(frames, size, fast=False)
    load.resize_frames(frames[:, :, :100, :100], (56, 56))  # 30000 values: torch's kernel
    assert len(asked) == 1, asked


def test_numba_failures_fall_back_to_torch(monkeypatch, caplog) -> None:
    """numba installed but unusable (its import raising, as it does with nowhere to cache the
    compiled kernels) or a kernel failing: a warning naming the error, no plan, and
    frame_resizer still gives torch's bytes."""
    import sys

    source, size = (240, 320), (112, 140)
    frames = _frames(source, seed=6)
    expected = load.resize_frames(frames.permute(0, 3, 1, 2), size, fast=False)

    class Unusable:
        def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201, ARG002
            if name == "apbv.video.bicubic_numba":
                raise RuntimeError("cannot cache function: no locator available")
            return None

    def broken(self):  # noqa: ANN001, ANN202
        raise ValueError("kernel failed")

    for break_it in ("import", "kernel"):
        bicubic.fast_plan.cache_clear()
        with monkeypatch.context() as patch, caplog.at_level(logging.WARNING):
            if break_it == "import":
                patch.delitem(sys.modules, "apbv.video.bicubic_numba", raising=False)
                patch.setattr(sys, "meta_path", [Unusable(), *sys.meta_path])
            else:
                patch.setattr(bicubic.FastPlan, "float_resizer", broken)
            assert bicubic.fast_plan(source, size) is None
            out = torch.empty((2, 3, *size), dtype=torch.uint8)
            resize = bicubic.frame_resizer(source, size)
            for k in range(2):
                resize(frames[k], out[k])
            assert torch.equal(out, expected)
        assert ("no locator" if break_it == "import" else "kernel failed") in caplog.text
        caplog.clear()
    bicubic.fast_plan.cache_clear()
    assert bicubic.fast_plan(source, size) is not None
