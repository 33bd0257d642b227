"""The one attention-kernel adapter: ``attention(q, k, v, causal=...) -> (out, lse)``.

Legend: B batch, Tq query rows, Tk keys, Hq query heads, Hkv KV heads (Hq % Hkv == 0, query head
h uses KV head h // (Hq // Hkv)), D head dim.

Backends, chosen per call (``backend=None`` picks the first that applies):

- ``"flash"``: flash-attn (FA3 ``flash_attn_interface`` or FA2 ``flash_attn``) for fp16/bf16
  on CUDA, if installed. GQA is native.
- ``"sdpa"``: PyTorch's own fused kernels that return the log-sum-exp. On CUDA torch's
  bundled FlashAttention-2 (:mod:`apbv.attention.bundled_flash`: one call, GQA native,
  bottom-right causal); where it refuses the call (fp32, head dim, compute capability; the
  reason is warned once) ``aten._scaled_dot_product_flash_attention`` (fp16/bf16) or
  ``aten._scaled_dot_product_efficient_attention`` (fp32), GQA by :func:`grouped` (no copy
  of K/V: the query group folded into rows, or one call per group member when causal). On
  CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` (GQA native).
- ``"reference"``: plain fp32 math, written for clarity; used by tests.

Mask alignment is the same for every backend: causal means **bottom-right** aligned, query row
i sees key j iff j <= i + Tk - Tq (flash-attn >= 2.1's convention). For Tq=2, Tk=4:

    keys    0 1 2 3
    row 0   x x x .
    row 1   x x x x

PyTorch's CPU and CUDA SDPA kernels align causal masks top-left when Tq != Tk and reject or
mishandle rows that see no key (the CPU kernel returns lse 0 there and crashes on Tk = 0;
flash-attn and torch's bundled FA2 return lse +inf). So this adapter never hands a kernel such
a case: rows that see no key get out 0, lse -inf here, and for the SDPA kernels a bottom-right
causal call with Tq < Tk is split into a non-causal prefix and a causal square merged by
log-sum-exp (the flash kernels align bottom-right themselves).

Version drift of flash-attn (2 vs 3 return tuples) lives in :func:`_flash`, nowhere else.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from functools import cache
from types import ModuleType

import torch

from apbv.attention import bundled_flash
from apbv.attention.merge import merge_partials
from apbv.config import KERNEL_BACKENDS as BACKENDS


@cache
def _flash_module() -> ModuleType | None:
    """flash-attn's Python interface if installed: FA3 (Hopper) first, then FA2."""
    for name in ("flash_attn_interface", "flash_attn"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def flash_available() -> bool:
    return torch.cuda.is_available() and _flash_module() is not None


@cache
def _warn_no_flash() -> None:
    warnings.warn(
        "flash-attn is not installed: CUDA attention uses torch's bundled flash kernel "
        "(PyTorch's SDPA kernels where it refuses a call; install the 'gpu' extra for "
        "flash-attn)",
        stacklevel=3,
    )


@cache
def _warn_sdpa_fallback(why: str) -> None:
    warnings.warn(f"CUDA attention uses PyTorch's SDPA kernels instead of torch's bundled "
                  f"flash kernel: {why}", stacklevel=3)


def default_backend(q: torch.Tensor) -> str:
    """flash-attn for fp16/bf16 CUDA tensors when installed, ``sdpa`` otherwise (on CUDA
    torch's bundled flash kernel where it takes the call)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        if _flash_module() is not None:
            return "flash"
        _warn_no_flash()
    return "sdpa"


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q over k/v that also returns the log-sum-exp.

    Args:
        q: (B, Tq, Hq, D).
        k, v: (B, Tk, Hkv, D), same dtype and device as q.
        causal: bottom-right aligned causal mask (see the module docstring).
        scale: softmax scale, default D ** -0.5.
        backend: one of BACKENDS, or None for the default on q's device.

    Returns:
        out (B, Tq, Hq, D) in q's dtype, lse (B, Hq, Tq) fp32 (natural log of the sum of
        exp(scale * q.k) over the visible keys). Rows with no visible key: out 0, lse -inf.
    """
    if backend is None:
        backend = default_backend(q)
    elif backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    assert k.shape == v.shape and k.shape[0] == b and k.shape[3] == d, (q.shape, k.shape, v.shape)
    assert hq % hkv == 0, (hq, hkv)
    if scale is None:
        scale = d**-0.5

    visible_from = tq - tk if causal else 0  # rows before this see no key
    if tq == 0 or tk == 0 or visible_from >= tq:
        return _no_keys(q)
    if visible_from > 0:
        out, lse = _no_keys(q)
        out[:, visible_from:], lse[:, :, visible_from:] = attention(
            q[:, visible_from:], k, v, causal=True, scale=scale, backend=backend
        )
        return out, lse

    if causal and tq == 1:  # bottom-right: the one row sees every key (a decode step)
        causal = False
    if backend == "reference":
        return _reference(q, k, v, causal, scale)
    if backend == "flash":
        return _flash(q, k, v, causal, scale)
    why_not = bundled_flash.refusal_for(q)
    if why_not is None:
        return bundled_flash.attend(q, k, v, causal=causal, scale=scale)
    if q.is_cuda:
        _warn_sdpa_fallback(why_not)
    if causal and tq < tk:
        # Fused PyTorch kernels align causal top-left: split off the fully visible prefix.
        prefix = _sdpa(q, k[:, : tk - tq], v[:, : tk - tq], False, scale)
        square = _sdpa(q, k[:, tk - tq :], v[:, tk - tq :], True, scale)
        out, lse = merge_partials([prefix[0], square[0]], [prefix[1], square[1]])
        return out.to(q.dtype), lse
    return _sdpa(q, k, v, causal, scale)


def attention_upto(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` without a mask of the rows q (B, Tq, Hq, D) over the first ``valid``
    keys of k/v (B, C, Hkv, D), ``valid`` a (1,) int64 tensor on their device: the shapes do
    not depend on the count, so the call can be captured in a CUDA graph over preallocated
    buffers (a decode step); at least one key must be valid. Returns out (B, Tq, Hq, D) in
    q's dtype, lse (B, Hq, Tq) fp32.

    On CUDA torch's bundled flash kernel reads only the valid keys (``seqused_k``, in q's
    dtype; :mod:`apbv.attention.bundled_flash`); where it refuses the call (CPU, fp32, ...)
    :func:`attention_upto_einsum`."""
    if bundled_flash.refusal_for(q) is None:
        return bundled_flash.attend(q, k, v, causal=False, scale=scale, valid=valid)
    return attention_upto_einsum(q, k, v, valid, scale)


def attention_upto_einsum(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_upto` in plain fp32 math over the whole buffers (every key's score
    computed, the invalid ones masked): grouped query heads as a view, no K/V repeat."""
    b, tq, hq, d = q.shape
    c, hkv = k.shape[1], k.shape[2]
    qg = q.float().view(b, tq, hkv, hq // hkv, d)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.float()) * scale  # (B, Hkv, G, Tq, C)
    hidden = torch.arange(c, device=k.device) >= valid
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.float()).reshape(b, tq, hq, d)
    return out.to(q.dtype), lse.reshape(b, hq, tq)


def _no_keys(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, tq, hq, _ = q.shape
    lse = torch.full((b, hq, tq), float("-inf"), dtype=torch.float32, device=q.device)
    return torch.zeros_like(q), lse


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    group = q.shape[2] // k.shape[2]
    kf = k.float().repeat_interleave(group, dim=2)
    vf = v.float().repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * scale
    if causal:
        tq, tk = q.shape[1], k.shape[1]
        visible = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vf)
    return out.to(q.dtype), lse


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's fused kernels; inputs here never have rows without a visible key."""
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D) views
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qh, kh, vh, 0.0, causal, scale=scale
        )
        return out.transpose(1, 2), lse
    out, lse = grouped(qh, kh, vh, causal, lambda a, b, c, m: _sdpa_cuda(a, b, c, m, scale))
    return out.transpose(1, 2), lse


def _sdpa_cuda(
    qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's CUDA kernels on (B, H, T, D), as many query heads as KV heads: out
    (B, H, Tq, D), lse (B, H, Tq) fp32."""
    if qh.dtype in (torch.float16, torch.bfloat16):
        result = torch.ops.aten._scaled_dot_product_flash_attention(
            qh, kh, vh, 0.0, causal, False, scale=scale
        )
    else:
        result = torch.ops.aten._scaled_dot_product_efficient_attention(
            qh, kh, vh, None, True, 0.0, causal, scale=scale
        )
    return result[0], result[1][..., : qh.shape[2]].float()  # efficient attn pads lse rows


EqualHeadsKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool],
                            tuple[torch.Tensor, torch.Tensor]]


def grouped(
    qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, causal: bool, kernel: EqualHeadsKernel
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention through a ``kernel`` that needs as many query as KV heads,
    without copying K or V (they are passed as they are).

    qh (B, Hq, Tq, D), kh/vh (B, Hkv, Tk, D); ``kernel(q, k, v, causal)`` returns out
    (B, H, Tq', D) and lse (B, H, Tq') for its own row count. Returns out (B, Hq, Tq, D), lse
    (B, Hq, Tq). Without a causal mask every row sees every key, so the query group of a KV
    head is folded into rows (one call, (B, Hkv, group * Tq, D)); a causal call (the mask
    depends on the row's position) runs once per group member g, on query heads
    g, g + group, ... (strided views of q)."""
    b, hq, tq, d = qh.shape
    group = hq // kh.shape[1]
    if group == 1:
        return kernel(qh, kh, vh, causal)
    if not causal:
        out, lse = kernel(qh.reshape(b, -1, group * tq, d), kh, vh, False)
        return out.reshape(b, hq, tq, d), lse.reshape(b, hq, tq)
    parts = [kernel(qh[:, g::group], kh, vh, True) for g in range(group)]
    out = torch.stack([o for o, _ in parts], dim=2)  # (B, Hkv, group, Tq, D): head kv*group+g
    lse = torch.stack([s for _, s in parts], dim=2)
    return out.reshape(b, hq, tq, d), lse.reshape(b, hq, tq)


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    module = _flash_module()
    if module is None or not q.is_cuda:
        raise ValueError("backend 'flash' needs CUDA tensors and flash-attn (the 'gpu' extra)")
    # FA2: (out, lse, S_dmask) with return_attn_probs=True. FA3: (out, lse) or (out, lse, ...).
    result = module.flash_attn_func(
        q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True
    )
    return result[0], result[1].float()
