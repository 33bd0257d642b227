"""The vision tower's patch embedding as one matrix product, on float rows or on pixel levels.

Qwen2.5-VL embeds each patch row (C * T * P * P values: channels, 2 frames, 14 x 14 pixels)
with a Conv3d whose kernel equals its stride, so every output is the dot product of one whole
row with one flattened kernel: ``rows @ weight.view(E, -1).T``. The stock module reshapes the
rows to (N, C, T, P, P) and runs the convolution, which is 2-3x slower than the matrix product
on CPU at every width we measured (64 to 1280 output channels). The result is the same sum in
another order (fp32: about 5e-6 apart at width 1280).

Pixel levels (int8 ``x - 128``, :func:`apbv.video.patches.patch_rows` with ``levels=True``):
the processor's rows are ``(x - m_c) / s_c`` per channel c, so the embedding is the affine map
``sum_j (W_j / s_c) x_j - sum_j W_j m_c / s_c``. On CPU in fp32 that runs as one integer
product (:func:`fold_levels`): the folded kernel ``A = W / s`` is split into
:data:`LEVEL_TERMS` int8 terms, ``A ~ sum_t scale_t * q_t`` (each term takes about 8 more
bits: after three a weight is off by at most 6e-8 of its row's largest), the levels times
every term are summed exactly in int32 (``torch._int_mm``), and one small float product
combines the terms and adds the constant. The result is the affine map to within fp32
rounding of its terms, closer to the exact sum than the float product of the rounded rows
(the tests: 1.6e-5 vs 4.1e-5 at outputs up to 72). It reads a quarter of the bytes and took
24 instead of 54 ms in one rank's tower (``benchmarks/bench_vision.py --parts``) on a CPU with
int8 dot-product instructions. Where torch's integer product is slow (on an AVX2-only AMD
EPYC it took a generic path: 0.92 s for 8192 rows, 70x the float product) the levels are
converted to fp32 block by block and multiplied by the folded kernel ``A`` in fp32 (13 ms for
those rows; within fp32 rounding of the affine map too): :func:`cpu_levels_product` times both
once per process and takes the faster. Elsewhere (a GPU, bf16 weights) the levels become the
processor's float rows on the device, bit for bit (:func:`apbv.video.patches.levels_to_rows`),
and take the float product.
"""

from __future__ import annotations

import functools
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from apbv.video.patches import levels_to_rows

if TYPE_CHECKING:
    from apbv.video.patches import PatchSpec

CPU_BLOCK_ROWS = 1024
"""Patch rows per product on CPU. The product is narrow (1176 values in, the tower's width
out): on one core, 8192 rows (one tower call's) in one product ran at about 45 GFLOP/s, in
blocks of 512-2048 rows at about 60, with the same bits."""

LEVEL_TERMS = 3
"""int8 terms of the folded kernel (see the module notes): after two a weight is off by up to
1.6e-5 of its row's largest, after three by 6e-8, below fp32's own rounding of the sum."""

LEVELS_PRODUCTS = ("int8", "float")
"""How a CPU multiplies pixel levels by the folded kernel (:func:`cpu_levels_product`)."""
LEVELS_PRODUCT: str | None = None
"""One of :data:`LEVELS_PRODUCTS` to use on CPU, or None: the faster, timed once."""


@dataclass(frozen=True)
class FoldedKernel:
    """The patch embedding on levels as ``addmm(bias, int_mm(levels, q).float(), combine)``."""

    q: torch.Tensor
    """int8 (K, LEVEL_TERMS * E): the terms of the folded kernel, side by side."""
    combine: torch.Tensor
    """float32 (LEVEL_TERMS * E, E): each term's scale on its diagonal block."""
    bias: torch.Tensor
    """float32 (E,): the affine map's constant, levels shifted by 128 included."""
    dense: torch.Tensor
    """float32 (K, E): the folded kernel ``A`` itself, for the float product."""
    offset: torch.Tensor
    """float32 (E,): the affine map's constant for ``dense``."""


def fold_levels(weight: torch.Tensor, spec: PatchSpec) -> FoldedKernel:
    """The :class:`FoldedKernel` of a patch-embedding ``weight`` (E, C, T, P, P) for the
    levels of rows made with ``spec`` (computed in float64)."""
    mean, std = (t.double() for t in spec.scaled(torch.device("cpu")))
    channel = (1, -1) + (1,) * (weight.dim() - 2)
    w = weight.detach().to("cpu", torch.float64)
    folded = (w / std.view(channel)).reshape(w.shape[0], -1)  # A: (E, K)
    constant = -(w * (mean / std).view(channel)).reshape(w.shape[0], -1).sum(1)
    scale = (folded.abs().amax(1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float64).tiny)
    rest, terms, scales = folded / scale, [], []
    for t in range(LEVEL_TERMS):
        q = rest.round().clamp(-127, 127)
        terms.append(q)
        scales.append(scale / 254.0 ** t)
        rest = (rest - q) * 254.0
    # what the integer product computes (summed in order, as sum() did)
    quantised = functools.reduce(operator.add, (s * q for s, q in zip(scales, terms)))
    e = w.shape[0]
    combine = torch.zeros(LEVEL_TERMS * e, e, dtype=torch.float64)
    for t, s in enumerate(scales):
        combine[t * e:(t + 1) * e] = torch.diag(s.squeeze(1))
    device = weight.device
    return FoldedKernel(
        q=torch.cat(terms).t().contiguous().to(device, torch.int8),
        combine=combine.to(device, torch.float32),
        bias=(constant + 128.0 * quantised.sum(1)).to(device, torch.float32),
        dense=folded.t().contiguous().to(device, torch.float32),
        offset=(constant + 128.0 * folded.sum(1)).to(device, torch.float32))


def cpu_levels_product() -> str:
    """``int8`` (torch._int_mm, the terms summed exactly) where this CPU runs it faster than
    ``float`` (levels to fp32 block by block, times the folded kernel), else ``float``; timed
    once per process on a small block (the best of 3 of each). :data:`LEVELS_PRODUCT`, when
    set, decides instead."""
    if LEVELS_PRODUCT is None:
        return _faster_levels_product()
    if LEVELS_PRODUCT not in LEVELS_PRODUCTS:
        raise ValueError(f"LEVELS_PRODUCT must be one of {', '.join(LEVELS_PRODUCTS)}, got "
                         f"{LEVELS_PRODUCT!r}")
    return LEVELS_PRODUCT


@functools.cache
def _faster_levels_product() -> str:
    if not hasattr(torch, "_int_mm"):
        return "float"
    g = torch.Generator().manual_seed(0)
    levels = torch.randint(-128, 128, (64, 1176), dtype=torch.int8, generator=g)
    terms = torch.randint(-127, 128, (1176, LEVEL_TERMS * 64), dtype=torch.int8, generator=g)
    dense = torch.randn(1176, 64, generator=g)

    def best(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    fast = best(lambda: torch._int_mm(levels, terms)) < best(lambda: levels.float() @ dense)
    return "int8" if fast else "float"


def _blocked(rows: torch.Tensor, kernel: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """``rows @ kernel (+ bias)`` on CPU in blocks of :data:`CPU_BLOCK_ROWS` rows, each block
    converted to the kernel's dtype first (int8 levels to fp32): rows (N, K), kernel (K, E)."""
    out = torch.empty(rows.shape[0], kernel.shape[1], dtype=kernel.dtype)
    for first in range(0, rows.shape[0], CPU_BLOCK_ROWS):
        block = rows[first:first + CPU_BLOCK_ROWS].to(kernel.dtype)
        where = out[first:first + CPU_BLOCK_ROWS]
        if bias is None:
            torch.mm(block, kernel, out=where)
        else:
            torch.addmm(bias, block, kernel, out=where)
    return out


def _folded(module: Any, weight: torch.Tensor, spec: PatchSpec) -> FoldedKernel:
    """``module``'s folded kernel, made again when its weight or the row settings change."""
    key = (weight.data_ptr(), weight._version, spec)
    cached = module.__dict__.get("_apbv_folded")
    if cached is None or cached[0] != key:
        cached = (key, fold_levels(weight, spec))
        module.__dict__["_apbv_folded"] = cached
    return cached[1]


def linear_patch_embed(module: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """The forward of ``module``, transformers' ``Qwen2_5_VisionPatchEmbed`` (typed ``Any``:
    torch's ``Module`` stub types every attribute ``Tensor | Module``), as a matrix product:
    patch rows (N, C * T * P * P) -> embeddings (N, E); on CPU in blocks of
    :data:`CPU_BLOCK_ROWS` rows. int8 rows are pixel levels, read with ``module.levels_spec``
    (the :class:`~apbv.video.patches.PatchSpec` they were made with; see the module notes)."""
    weight = module.proj.weight  # (E, C, T, P, P), flattened in the rows' order
    if hidden_states.dtype == torch.int8:
        spec = module.__dict__.get("levels_spec")
        if spec is None:
            raise ValueError("int8 patch rows (pixel levels) need the patch embedding's "
                             "levels_spec: the processor settings they were made with")
        if hidden_states.device.type == "cpu" and weight.dtype == torch.float32:
            kernel = _folded(module, weight, spec)
            if cpu_levels_product() == "float":
                return _blocked(hidden_states, kernel.dense, kernel.offset)
            products = torch._int_mm(hidden_states, kernel.q)
            return torch.addmm(kernel.bias, products.to(torch.float32), kernel.combine)
        hidden_states = levels_to_rows(hidden_states, spec)
    kernel = weight.reshape(weight.shape[0], -1)
    rows = hidden_states.to(weight.dtype)
    if rows.device.type != "cpu" or rows.shape[0] <= CPU_BLOCK_ROWS:
        return torch.nn.functional.linear(rows, kernel)
    return _blocked(rows, kernel.t())
