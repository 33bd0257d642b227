"""The vision tower's MLPs and RMSNorms as a GPU runs them fast, with the same arithmetic.

Profiled on one H200 (bf16, Qwen2.5-VL-7B's tower on 16 temporal patches of 40 x 72, 46k
rows): transformers' tower with the grouped attention took 0.35 s, almost all of it on the
device. Its MLP products alone took 0.16 s at about 220 TFLOP/s: the MLP's hidden width, 3420,
is not a multiple of 8, so the rows of the (46k, 3420) activations are not 16-byte aligned and
cuBLAS falls back from Hopper's kernels to Ampere's. The qkv product of the same rows ran at
about 600. The norms' five passes in fp32 were most of the rest of the elementwise time.

- :func:`pad_mlp` gives every block's MLP a hidden width that is a multiple of
  ``vision.mlp_pad`` (64 on CUDA by default): the added units have zero weights and biases, so
  their activation is ``act(0) * 0 = 0`` and they add exact zeros to the down projection. The
  result is the same sum; only the kernel's order of adding its products changes (rounding of
  the fp32 accumulator).
- :func:`fused_rms_norm` runs transformers' RMSNorm (fp32 statistics, the normalised value
  rounded once to the input dtype, then times the weight) as ``torch.rms_norm``, one kernel, on
  CUDA in bf16/fp16; elsewhere the stock forward runs. The statistic is summed in another order,
  so a value may differ in its last bit.
"""

from __future__ import annotations

from typing import Any

import torch

CUDA_MLP_PAD = 64
"""``vision.mlp_pad`` left unset on CUDA: the MLP's hidden width is padded to a multiple of
this (3420 -> 3456 for the 3B/7B/72B towers), enough for 16-byte aligned bf16 rows and whole
tiles of the fast kernels."""


def pad_mlp(visual: Any, multiple: int) -> None:
    """Pad the hidden width of every MLP of the vision tower ``visual`` (a transformers module,
    typed ``Any``: torch's ``Module`` stub types its attributes ``Tensor | Module``) with zero
    units to a multiple of ``multiple`` (0: back to the checkpoint's width,
    ``config.intermediate_size``). The weights of the real units are kept as they are; only
    this instance changes."""
    if multiple < 0:
        raise ValueError(f"vision.mlp_pad must be >= 0, got {multiple}")
    width = visual.config.intermediate_size
    target = width if multiple == 0 else -(-width // multiple) * multiple
    for block in visual.blocks:
        mlp = block.mlp
        if mlp.gate_proj.out_features == target:
            continue
        assert mlp.gate_proj.out_features >= width, "an MLP narrower than the config"
        for linear in (mlp.gate_proj, mlp.up_proj):
            linear.weight = _resized(linear.weight, 0, width, target)
            if linear.bias is not None:
                linear.bias = _resized(linear.bias, 0, width, target)
            linear.out_features = target
        mlp.down_proj.weight = _resized(mlp.down_proj.weight, 1, width, target)
        mlp.down_proj.in_features = target


def _resized(param: torch.nn.Parameter, dim: int, keep: int, size: int) -> torch.nn.Parameter:
    """``param`` with ``size`` entries along ``dim``: its first ``keep``, then zeros."""
    shape = list(param.shape)
    shape[dim] = size
    out = param.new_zeros(shape)
    out.narrow(dim, 0, keep).copy_(param.detach().narrow(dim, 0, keep))
    return torch.nn.Parameter(out, requires_grad=param.requires_grad)


def fused_rms_norm(module: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """The forward of transformers' Qwen2.5-VL RMSNorm, ``weight * (x * rsqrt(mean(x^2) +
    eps)).to(x.dtype)`` with the statistic in fp32: one ``torch.rms_norm`` kernel (fp32
    statistics, rounded once to the input dtype) for bf16/fp16 on CUDA, the stock forward
    elsewhere."""
    if hidden_states.device.type != "cuda" or \
            hidden_states.dtype not in (torch.bfloat16, torch.float16):
        return type(module).forward(module, hidden_states)
    normed = torch.rms_norm(hidden_states, (hidden_states.shape[-1],), None,
                            module.variance_epsilon)
    return module.weight * normed
