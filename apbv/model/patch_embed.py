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


def linear_patch_embed(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The forward of transformers' ``Qwen2_5_VisionPatchEmbed`` as a matrix product:
    patch rows (N, C * T * P * P) -> embeddings (N, E)."""
    weight = module.proj.weight  # (E, C, T, P, P), flattened in the rows' order
    return torch.nn.functional.linear(hidden_states.to(weight.dtype),
                                      weight.reshape(weight.shape[0], -1))
