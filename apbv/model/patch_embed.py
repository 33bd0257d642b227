"""The vision tower's patch embedding as one matrix product.

Qwen2.5-VL embeds each patch row (C * T * P * P values: channels, 2 frames, 14 x 14 pixels)
with a Conv3d whose kernel equals its stride, so every output is the dot product of one whole
row with one flattened kernel: ``rows @ weight.view(E, -1).T``. The stock module reshapes the
rows to (N, C, T, P, P) and runs the convolution, which is 2-3x slower than the matrix product
on CPU at every width we measured (64 to 1280 output channels). The result is the same sum in
another order (fp32: about 5e-6 apart at width 1280).
"""

from __future__ import annotations

import torch

PATCH_EMBED = ("linear", "conv")
"""``vision.patch_embed``: linear (:func:`linear_patch_embed`) or conv (the stock Conv3d)."""

CPU_BLOCK_ROWS = 1024
"""Patch rows per product on CPU. The product is narrow (1176 values in, the tower's width
out): on one core, 8192 rows (one tower call's) in one product ran at about 45 GFLOP/s, in
blocks of 512-2048 rows at about 60, with the same bits."""


def linear_patch_embed(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The forward of transformers' ``Qwen2_5_VisionPatchEmbed`` as a matrix product:
    patch rows (N, C * T * P * P) -> embeddings (N, E); on CPU in blocks of
    :data:`CPU_BLOCK_ROWS` rows."""
    weight = module.proj.weight  # (E, C, T, P, P), flattened in the rows' order
    kernel = weight.reshape(weight.shape[0], -1)
    rows = hidden_states.to(weight.dtype)
    if rows.device.type != "cpu" or rows.shape[0] <= CPU_BLOCK_ROWS:
        return torch.nn.functional.linear(rows, kernel)
    out = rows.new_empty(rows.shape[0], kernel.shape[0])
    for first in range(0, rows.shape[0], CPU_BLOCK_ROWS):
        torch.mm(rows[first:first + CPU_BLOCK_ROWS], kernel.t(),
                 out=out[first:first + CPU_BLOCK_ROWS])
    return out
