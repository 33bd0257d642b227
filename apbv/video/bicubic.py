"""One decoded CPU frame resized as torchvision resizes it (antialiased bicubic), bit for bit:
torch's kernel, or one about 5x faster with the same bits (3.4 against 17 ms from 1080p to
140 x 84 on one core) where it has been shown to give them.

torchvision resizes a uint8 frame as torch's ``_upsample_bicubic2d_aa`` on a float32 copy, then
clamps and rounds. That kernel makes two one-axis passes (along the width, then along the
height; an axis of unchanged size is skipped), and each output value is the sum over its
window of source values times weights, in a fixed order. The kernel is scalar: about 15 ms per
1080p frame, as much as decoding the frames walked to reach it. :mod:`apbv.video.bicubic_numba`
computes every value with the same weights (read from torch's own kernel), the same float32
operations and the same order, vectorized across 16 rows at a time.

That order is the one torch's compiled kernel has, not its source's: in its AVX2 and AVX512
builds a window's taps are added one by one except the last ``(n - 1) % 4``, which are fused
multiply-adds (the compiler's unrolling by four, contracted in the remainder loop; found by
resizing rows whose later taps were zeroed). Another build may differ, so a source and
target size are resized by the fast kernel only after it gave torch's values on a random
frame of that size (:func:`fast_plan`, once per size and process, about 50 ms for 1080p),
trying each order of :data:`GROUPINGS`; otherwise, and without numba, torch's kernel runs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import numpy as np
import torch

from apbv.video.sampling import _import

log = logging.getLogger(__name__)

Windows = tuple[np.ndarray, np.ndarray, np.ndarray]
"""(starts int64 (n,), sizes int64 (n,), weights float32 (n, max size)) of one axis."""

Resizer = Callable[[torch.Tensor, torch.Tensor], None]
"""(frame uint8 (H, W, 3), out uint8 (3, h, w)) -> None: ``out`` = the resized frame."""

FAST_MIN_VALUES = 1 << 17
"""Frames of fewer uint8 values (3 x H x W; about 210 x 210 pixels) keep torch's kernel: it
takes well under a millisecond there, less than the fast kernel's one-time check."""

GROUPINGS = (4, 1, 0, 2, 8)
"""The summation orders tried (``group`` of :func:`apbv.video.bicubic_numba.window_sum`): 4 as
torch 2.14's x86 wheel adds with its AVX2 and AVX512 kernels; 1 every tap added on its own (the
source's order; its kernel for CPUs without either, ``ATEN_CPU_CAPABILITY=default``); 0 every
tap after the first a fused multiply-add."""


def resize_frame_into(frame: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> None:
    """Torch's kernel on one CPU frame, uint8 (H, W, 3), written into ``out`` (uint8 (3, h, w)):
    the pixels of :func:`apbv.video.load.resize_frames`, bit for bit, with less memory traffic.
    torchvision resizes a uint8 tensor as a float32 copy, the bicubic antialiased
    interpolation, a clamp to [0, 255] and rounding; here the float32 copy goes into
    ``scratch`` (float32 (1, 3, H, W), planar, reused from frame to frame) instead of a new
    channels-last tensor per frame, and the decoder's frames need not be stacked first. Each
    interpolated value is the same sum of the same products in the same order whatever the
    input's memory layout (tests/unit/test_video_convert.py)."""
    functional = _import("torchvision.transforms.functional", "torchvision", "frame resizing")
    assert frame.dtype == torch.uint8 and frame.dim() == 3 and frame.shape[2] == 3, frame.shape
    assert scratch.shape == (1, 3, *frame.shape[:2]), (scratch.shape, frame.shape)
    chw = frame.permute(2, 0, 1)
    if tuple(out.shape[1:]) == tuple(frame.shape[:2]):
        out.copy_(chw)  # torchvision returns a frame of the asked size unchanged
        return
    scratch[0].copy_(chw)
    resized = functional.resize(scratch, list(out.shape[1:]),
                                interpolation=functional.InterpolationMode.BICUBIC,
                                antialias=True)
    out.copy_(resized[0].clamp_(0, 255).round_())


def frame_resizer(source: tuple[int, int], size: tuple[int, int]) -> Resizer:
    """A resizer of CPU frames of ``source`` (H, W) to ``size`` (h, w), with buffers of its own
    (one per reader; not to be shared between threads): the fast kernel where
    :func:`fast_plan` has one, else :func:`resize_frame_into` with its scratch buffer."""
    plan = fast_plan(source, size) if 3 * source[0] * source[1] >= FAST_MIN_VALUES else None
    if plan is not None:
        return plan.resizer()
    scratch = torch.empty((1, 3, *source), dtype=torch.float32)
    return lambda frame, out: resize_frame_into(frame, out, scratch)


def _windows(n_in: int, n_out: int) -> Windows | None:
    """Torch's antialiased bicubic windows from ``n_in`` source to ``n_out`` target values:
    (starts int64 (n_out,), sizes int64 (n_out,), weights float32 (n_out, max size)). The
    ranges follow torch's rule in its float32 arithmetic (the scale a float32 quotient, each
    center and bound rounded to float32 before the + 0.5 and the truncation; in double
    precision some bounds that are whole numbers come out one higher); the weights are read
    from torch's kernel itself, resizing an identity matrix along one axis (each output value
    is then exactly one weight). None when a weight lies outside its range (another rule)."""
    functional = _import("torchvision.transforms.functional", "torchvision", "frame resizing")
    f32 = np.float32
    scale = f32(n_in) / f32(n_out)
    support = f32(2.0 * float(scale)) if scale >= 1.0 else f32(2.0)
    starts = np.empty(n_out, np.int64)
    sizes = np.empty(n_out, np.int64)
    for i in range(n_out):
        center = f32(float(scale) * (i + 0.5))
        starts[i] = max(int(float(center - support) + 0.5), 0)
        sizes[i] = min(int(float(center + support) + 0.5), n_in) - starts[i]
    identity = torch.eye(n_in).reshape(1, 1, n_in, n_in)
    probe = functional.resize(identity, [n_in, n_out],
                              interpolation=functional.InterpolationMode.BICUBIC,
                              antialias=True)[0, 0].numpy()  # (source, target)
    weights = np.zeros((n_out, int(sizes.max())), np.float32)
    for i in range(n_out):
        lo, hi = int(starts[i]), int(starts[i] + sizes[i])
        column = probe[:, i]
        if column[:lo].any() or column[hi:].any():
            return None
        weights[i, :hi - lo] = column[lo:hi]
    return starts, sizes, weights


@dataclasses.dataclass(frozen=True)
class FastPlan:
    """The fast kernel's windows for one source size (H, W) and target size (h, w), and the
    summation order (``group``) that gave torch's values; empty windows: the axis keeps its
    size (no pass)."""

    source: tuple[int, int]
    size: tuple[int, int]
    across: Windows
    down: Windows
    group: int

    def resizer(self) -> Resizer:
        """A :data:`Resizer` with its own scratch buffers (about 4 bytes x H x 3w)."""
        import apbv.video.bicubic_numba as kernels

        rows = self.float_resizer()

        def resize(frame: torch.Tensor, out: torch.Tensor) -> None:
            assert out.shape == (3, *self.size) and out.dtype == torch.uint8, out.shape
            kernels.to_uint8(rows(frame), out.numpy())

        return resize

    def float_resizer(self) -> Callable[[torch.Tensor], np.ndarray]:
        """frame uint8 (H, W, 3) -> the interpolated values before the cast, float32
        (h, w * 3), target column o of channel c at 3o + c (a buffer reused by each call)."""
        import apbv.video.bicubic_numba as kernels

        (height, width), (h, w) = self.source, self.size
        block = np.empty((width, 3 * kernels.ROWS), np.uint8)
        tmp = np.empty((height, 3 * w), np.float32)
        rows = np.empty((h, 3 * w), np.float32) if h != height else tmp

        def resize(frame: torch.Tensor) -> np.ndarray:
            assert frame.shape == (height, width, 3) and frame.dtype == torch.uint8, frame.shape
            src = np.ascontiguousarray(frame.numpy())
            if w != width:
                kernels.widthwise(src, *self.across, self.group, tmp, block)
            else:
                kernels.as_float(src, tmp)
            kernels.heightwise(tmp, *self.down, self.group, rows)
            return rows

        return resize


@functools.lru_cache(maxsize=16)
def fast_plan(source: tuple[int, int], size: tuple[int, int]) -> FastPlan | None:
    """The fast kernel's plan for ``source`` (H, W) -> ``size`` (h, w), once it gave torch's
    interpolated float32 values, every bit, on a random frame of that size (not only the
    rounded bytes, which a one-ulp difference rarely changes) in one of the orders of
    :data:`GROUPINGS`; None without numba, when no order did, or when numba fails (for
    instance with nowhere to cache its compiled kernels; logged): torch's kernel then resizes,
    with the same bytes."""
    try:
        import apbv.video.bicubic_numba  # noqa: F401 - numba is installed
    except ImportError:
        return None
    except Exception as err:  # numba installed but unusable here
        log.warning("fast resize unavailable (%s: %s); torch's kernel resizes",
                    type(err).__name__, err)
        return None
    try:
        return _checked_plan(source, size)
    except Exception as err:  # a kernel that fails to compile or run: the exact fallback
        log.warning("fast resize %s -> %s failed (%s: %s); torch's kernel resizes", source,
                    size, type(err).__name__, err)
        return None


def _checked_plan(source: tuple[int, int], size: tuple[int, int]) -> FastPlan | None:
    """:func:`fast_plan` once numba imports."""
    (height, width), (h, w) = source, size
    none: Windows = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 1), np.float32))
    across = _windows(width, w) if w != width else none
    down = _windows(height, h) if h != height else none
    if across is None or down is None:
        log.info("fast resize %s -> %s: torch's windows follow another rule; torch's kernel "
                 "resizes", source, size)
        return None
    functional = _import("torchvision.transforms.functional", "torchvision", "frame resizing")
    gen = torch.Generator().manual_seed(height * 7919 + width)
    frame = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=gen)
    expected = functional.resize(frame.permute(2, 0, 1)[None].float(), [h, w],
                                 interpolation=functional.InterpolationMode.BICUBIC,
                                 antialias=True)[0].permute(1, 2, 0).reshape(h, 3 * w)
    for group in GROUPINGS:
        plan = FastPlan(source, size, across, down, group)
        if torch.equal(torch.from_numpy(plan.float_resizer()(frame)), expected):
            return plan
    log.info("fast resize %s -> %s: no summation order gives torch's values on this machine; "
             "torch's kernel resizes", source, size)
    return None
