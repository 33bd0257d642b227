"""The compiled half of :mod:`apbv.video.bicubic`: numba kernels of the two one-axis passes of
torch's antialiased bicubic resize, summing each window in an order given by ``group``
(imported only when numba is installed; the kernels compile once and are cached on disk)."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

ROWS = 16
"""Frame rows resized together along the width: 3 x 16 lanes per source column."""


@intrinsic
def _fma(typingctx, a, b, c):  # noqa: ANN001, ANN202, ARG001 - numba's intrinsic protocol
    """float32 ``a * b + c`` rounded once (LLVM's fma intrinsic)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202, ARG001
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32] * 3))
        return builder.call(fn, args)

    return sig, codegen


@njit(cache=True, nogil=True)
def window_sum(rows, start, size, weights, group, acc):  # noqa: ANN001, ANN201
    """``acc[k]`` = the sum over j < ``size`` of ``rows[start + j, k] * weights[j]``, float32,
    in this order: the first product, then one product added at a time (each product and sum
    rounded), with the taps after ``1 + group * ((size - 1) // group)`` fused multiply-adds
    instead (``group`` 0: every tap after the first). rows: uint8 or float32 (N, lanes), each
    value taken as float32; acc: float32 (lanes,)."""
    lanes = acc.shape[0]
    plain = 0 if group == 0 else (size - 1) - (size - 1) % group
    first, w0 = rows[start], weights[0]
    for k in range(lanes):
        acc[k] = np.float32(first[k]) * w0
    j = 1
    while j + 3 <= plain:  # four taps per pass over acc, each still added on its own
        ta, tb = rows[start + j], rows[start + j + 1]
        tc, td = rows[start + j + 2], rows[start + j + 3]
        wa, wb, wc, wd = weights[j], weights[j + 1], weights[j + 2], weights[j + 3]
        for k in range(lanes):
            acc[k] = (((acc[k] + np.float32(ta[k]) * wa) + np.float32(tb[k]) * wb)
                      + np.float32(tc[k]) * wc) + np.float32(td[k]) * wd
        j += 4
    while j <= plain:
        ta, wa = rows[start + j], weights[j]
        for k in range(lanes):
            acc[k] = acc[k] + np.float32(ta[k]) * wa
        j += 1
    while j < size:
        ta, wa = rows[start + j], weights[j]
        for k in range(lanes):
            acc[k] = _fma(np.float32(ta[k]), wa, acc[k])
        j += 1


@njit(cache=True, nogil=True)
def widthwise(src, starts, sizes, weights, group, tmp, block):  # noqa: ANN001, ANN201
    """The pass along the width: uint8 ``src`` (H, W, 3) -> float32 ``tmp`` (H, w * 3), output
    column o of channel c at ``tmp[y, 3 * o + c]``. ``block``: uint8 (W, 3 * ROWS) scratch,
    :data:`ROWS` rows of ``src`` at a time laid out column by column (lanes c * ROWS + r)."""
    height, width = src.shape[0], src.shape[1]
    acc = np.empty(3 * ROWS, np.float32)
    for y0 in range(0, height, ROWS):
        for x in range(width):
            for c in range(3):
                for r in range(ROWS):  # past the last row: copies of it, never stored
                    block[x, c * ROWS + r] = src[min(y0 + r, height - 1), x, c]
        for o in range(starts.shape[0]):
            window_sum(block, starts[o], sizes[o], weights[o], group, acc)
            for r in range(min(ROWS, height - y0)):
                for c in range(3):
                    tmp[y0 + r, 3 * o + c] = acc[c * ROWS + r]


@njit(cache=True, nogil=True)
def as_float(src, tmp):  # noqa: ANN001, ANN201
    """uint8 ``src`` (H, W, 3) -> float32 ``tmp`` (H, W * 3): no pass along the width."""
    height, width = src.shape[0], src.shape[1]
    for y in range(height):
        for x in range(width):
            for c in range(3):
                tmp[y, 3 * x + c] = np.float32(src[y, x, c])


@njit(cache=True, nogil=True)
def heightwise(tmp, starts, sizes, weights, group, rows):  # noqa: ANN001, ANN201
    """The pass along the height: float32 ``tmp`` (H, w * 3) -> float32 ``rows`` (h, w * 3);
    empty ``starts``: no pass (``rows`` is ``tmp``, not written)."""
    for o in range(starts.shape[0]):
        window_sum(tmp, starts[o], sizes[o], weights[o], group, rows[o])


@njit(cache=True, nogil=True)
def to_uint8(rows, out):  # noqa: ANN001, ANN201
    """float32 ``rows`` (h, w * 3) -> uint8 ``out`` (3, h, w): clamped to [0, 255] and rounded
    half to even, as torchvision casts a resized float frame."""
    for y in range(rows.shape[0]):
        for k in range(rows.shape[1]):
            value = min(max(rows[y, k], np.float32(0.0)), np.float32(255.0))
            out[k % 3, y, k // 3] = np.uint8(np.rint(value))
