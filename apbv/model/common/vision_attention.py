"""The vision tower's attention in few kernel calls: equal-length segments batched together.

Qwen2.5-VL's vision blocks attend inside segments of the packed patch sequence, given by
``cu_seqlens``: windows in the windowed blocks, whole temporal patches in the full-attention
blocks. The windows of one frame have at most four sizes (interior, right edge, bottom edge,
corner) and every temporal patch of a video has the same size, so the segments fall into at
most four groups of equal length. :func:`segment_attention` runs one batched SDPA call per
group, (n, H, L, D), instead of one call per segment; on CUDA a varlen kernel (flash-attn's
``flash_attn_varlen_func``, else PyTorch's own varlen attention) takes every segment in one call.

Attention stays exact: each query sees exactly the keys of its own segment.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any

import torch

MAX_SCORES_PER_CALL = 1 << 28
"""Bound on batch * heads * L * L of one batched call, so that a kernel that materialises
the scores (the math fallback) stays within memory; larger groups are cut in chunks."""


Group = tuple[int, int, "torch.Tensor | int"]
"""(segment length L, number of segments n, start row when the n segments are one contiguous
run, else the (n * L,) row index of the segments in order)."""


def _plan(cu_seqlens: torch.Tensor) -> list[Group]:
    """The equal-length groups of the segments given by ``cu_seqlens`` (empty ones dropped)."""
    bounds = [int(x) for x in cu_seqlens.tolist()]
    starts: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            starts.setdefault(end - start, []).append(start)
    groups: list[Group] = []
    for length, first in starts.items():
        if all(b - a == length for a, b in zip(first[:-1], first[1:])):
            groups.append((length, len(first), first[0]))  # one run: views, no gather
        else:
            rows = torch.tensor(first).unsqueeze(1) + torch.arange(length)
            groups.append((length, len(first), rows.reshape(-1).to(cu_seqlens.device)))
    return groups


class _PlanCache:
    """The plans of the last few ``cu_seqlens`` tensors (the tower passes the same two tensors,
    windows and temporal patches, to every block); a held reference keeps identity sound."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self.entries: list[tuple[torch.Tensor, list[Group]]] = []

    def get(self, cu_seqlens: torch.Tensor) -> list[Group]:
        for tensor, plan in self.entries:
            if tensor is cu_seqlens:
                return plan
        plan = _plan(cu_seqlens)
        self.entries = [(cu_seqlens, plan), *self.entries[: self.size - 1]]
        return plan


_PLANS = _PlanCache()


def _flash_varlen() -> Any:
    if importlib.util.find_spec("flash_attn") is None:
        return None
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def _torch_varlen() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_kernel(q: torch.Tensor) -> Any:
    """The one-call varlen kernel usable for ``q`` (CUDA, fp16/bf16), or None."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    return _flash_varlen() or _torch_varlen()


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
             scale: float) -> torch.Tensor:
    """One SDPA call per group of equal-length segments (chunked by MAX_SCORES_PER_CALL)."""
    _, heads, dim = q.shape
    out = q.new_empty(q.shape)  # contiguous: groups are written into views of it
    for length, count, where in _PLANS.get(cu_seqlens):
        per_call = max(1, MAX_SCORES_PER_CALL // (heads * length * length))
        for first in range(0, count, per_call):
            n = min(per_call, count - first)
            if isinstance(where, int):
                lo, hi = where + first * length, where + (first + n) * length
                qg, kg, vg = q[lo:hi], k[lo:hi], v[lo:hi]
            else:
                idx = where[first * length:(first + n) * length]
                qg, kg, vg = (t.index_select(0, idx) for t in (q, k, v))
            qg, kg, vg = (t.reshape(n, length, heads, dim).transpose(1, 2) for t in (qg, kg, vg))
            og = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, scale=scale)
            if isinstance(where, int):  # straight into place: one copy
                out[lo:hi].view(n, length, heads, dim).copy_(og.transpose(1, 2))
            else:
                out.index_copy_(0, idx, og.transpose(1, 2).reshape(n * length, heads, dim))
    return out


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens: torch.Tensor | None, scale: float,
                      max_seqlen: int | None = None) -> torch.Tensor:
    """Attention inside each segment of a packed sequence: q/k/v (S, H, D), segments
    [cu_seqlens[i], cu_seqlens[i + 1]) (None: one segment) -> (S, H, D)."""
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    kernel = varlen_kernel(q)
    if kernel is not None:
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        if max_seqlen is None:
            max_seqlen = int((cu[1:] - cu[:-1]).max())
        if kernel is _flash_varlen():
            return kernel(q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale)
        if "scale" in inspect.signature(kernel).parameters:
            return kernel(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale)
        if scale == q.shape[-1] ** -0.5:  # older PyTorch: the default scale only
            return kernel(q, k, v, cu, cu, max_seqlen, max_seqlen)
    return _grouped(q, k, v, cu_seqlens, scale)


def hf_vision_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature for the vision tower: q/k/v (1, H, S, D)
    and the segments as ``cu_seq_lens_q`` (the packed call) or none (one segment) ->
    (1, S, H, D)."""
    if attention_mask is not None:
        raise ValueError("the grouped vision attention takes segments, not a mask")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = segment_attention(q, k, v, cu_seq_lens_q, scale, max_length_q)
    return out.unsqueeze(0), None


def _pair(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q and k (S, H, D) as one (S, 2, H, D) tensor: a view where they are views of one
    tensor with the same strides and k after q (the tower cuts them out of its packed qkv
    product in that order), else a stacked copy."""
    gap = k.storage_offset() - q.storage_offset()
    if q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() \
            and q.stride() == k.stride() and gap >= 0:
        return q.as_strided((q.shape[0], 2, *q.shape[1:]), (q.stride(0), gap, *q.stride()[1:]),
                            q.storage_offset())
    return torch.stack((q, k), 1)


def fused_rotary(stock: Any) -> Any:
    """transformers' vision rotary ``stock(q, k, cos, sin)`` for q and k (S, H, D) with q and
    k in one set of passes, bit for bit.

    The stock function computes ``x * cos + rotate_half(x) * sin`` in fp32 (bf16/fp16 q and k
    are upcast first and the results rounded back once), for q, then for k, on the strided
    views the tower cuts out of its qkv product, with ``rotate_half(x) = [-x2, x1]`` for the
    halves ``x1, x2``. Here q and k go together as one (S, 2, H, D) tensor and the negation
    moves to sin: ``x * cos + [x2, x1] * [-s1, s2]``, the same products and sums, each rounded
    once (a negation and the upcast are exact), so the bits are the same, in four passes over
    q and k together instead of ten over each (2-3x faster than the stock function on CPU at
    8192 rows in fp32). bf16/fp16 values are upcast inside the products rather than copied
    first, and the swapped halves are two products into the halves of one buffer rather
    than a roll (on an H200 the roll alone took 0.6 ms per block at 46k rows). Other dtypes,
    and q or k that need gradients, go to ``stock``.
    """
    def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if q.dtype not in (torch.float32, torch.bfloat16, torch.float16) \
                or k.dtype != q.dtype or q.shape != k.shape \
                or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
            return stock(q, k, cos, sin)  # training: the in-place passes have no backward
        x = _pair(q, k)
        n, half = x.shape[0], x.shape[-1] // 2
        sin = sin.float()
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), -1).reshape(n, 1, 1, -1)
        out = x * cos.float().reshape(n, 1, 1, -1)  # fp32 (bf16 x is upcast exactly)
        if x.dtype == torch.float32:
            out += x.roll(half, -1).mul_(signed_sin)  # [x2, x1] * [-s1, s2]
            return out[:, 0], out[:, 1]
        # bf16/fp16: the two half products written in place of a roll (a slow gather on
        # CUDA), each still rounded once in fp32
        swapped = torch.empty_like(out)
        torch.mul(x[..., half:], signed_sin[..., :half], out=swapped[..., :half])
        torch.mul(x[..., :half], signed_sin[..., half:], out=swapped[..., half:])
        out = out.add_(swapped).to(x.dtype)
        return out[:, 0], out[:, 1]

    apply.stock = stock  # type: ignore[attr-defined]
    return apply
