"""torch's own FlashAttention-2 kernel (``aten._flash_attention_forward``) behind the adapter's
contract: the ``sdpa`` backend's kernel on CUDA, and the captured decode's owner attention.

Legend as in :mod:`apbv.attention.kernels`: B batch, Tq query rows, Tk keys, Hq query heads,
Hkv KV heads (Hq % Hkv == 0), D head dim.

torch bundles FA2 in its CUDA builds, so no flash-attn wheel is needed. The kernel takes
grouped-query attention natively (K/V with fewer heads, no copy), returns the log-sum-exp,
aligns a causal mask bottom-right (row i of Tq sees key j iff j <= i + Tk - Tq) and, given
``seqused_k``, reads only the first ``seqused_k[b]`` keys of sequence b: a valid length that
lives on the device, so a call over a preallocated buffer has fixed shapes and can be captured
in a CUDA graph.

The op is always called in its variable-length form, the only one that takes ``seqused_k``:
rows flattened to (B * Tq, Hq, D) and (B * Tk, Hkv, D) with int32 offsets
``cu_seq_q = [0, Tq, 2 Tq, ...]`` and ``cu_seq_k = [0, Tk, ...]`` (:func:`varlen_args`). In
that form the op returns out (B * Tq, Hq, D) and lse (Hq, B * Tq); :func:`lse_to_bht` turns
the latter into the project's (B, Hq, Tq) fp32.

Where the kernel cannot run (not CUDA, fp32, D > 256 or not a multiple of 8, compute
capability outside [8.0, 12.1], a torch built without it, ROCm), :func:`refusal` says why in
one line and the caller keeps its other path. The refusal is a pure function of those facts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

DTYPES = (torch.float16, torch.bfloat16)
"""The dtypes the kernel takes."""
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
CAPABILITIES = ((8, 0), (12, 1))
"""The lowest and highest CUDA compute capability torch's flash kernel runs on."""

FlashOp = Callable[..., tuple[torch.Tensor, ...]]
"""``aten._flash_attention_forward``'s calling convention (tests pass a CPU stand-in)."""


def refusal(device_type: str, dtype: torch.dtype, head_dim: int,
            capability: tuple[int, int] | None, built: bool, rocm: bool = False) -> str | None:
    """Why torch's bundled flash kernel cannot take a call, or None when it can.

    Args:
        device_type: the tensors' device type ("cuda", "cpu", ...).
        dtype: the query's dtype (K and V share it).
        head_dim: D.
        capability: the CUDA device's (major, minor), None off CUDA.
        built: whether this torch has the kernel (built with flash attention, the op present).
        rocm: a ROCm build, whose flash kernel is a different implementation.
    """
    if device_type != "cuda":
        return f"the tensors are on {device_type}, the kernel runs on CUDA only"
    if rocm:
        return "a ROCm build of torch (its flash kernel is not FA2's; not checked here)"
    if not built:
        return "this torch was built without its flash attention kernel"
    if dtype not in DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')}: the kernel takes float16 or bfloat16"
    if head_dim > MAX_HEAD_DIM or head_dim % HEAD_DIM_MULTIPLE:
        return (f"head dim {head_dim}: the kernel takes at most {MAX_HEAD_DIM}, a multiple of "
                f"{HEAD_DIM_MULTIPLE}")
    low, high = CAPABILITIES
    if capability is None or not low <= capability <= high:
        shown = "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
        return (f"compute capability {shown}: the kernel runs on {low[0]}.{low[1]} to "
                f"{high[0]}.{high[1]}")
    return None


@cache
def _built() -> bool:
    return bool(torch.backends.cuda.is_flash_attention_available()) and \
        hasattr(torch.ops.aten, "_flash_attention_forward")


@cache
def _capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return major, minor


def refusal_for(q: torch.Tensor) -> str | None:
    """:func:`refusal` for a query tensor (B, Tq, Hq, D) on its device (cached per device)."""
    if q.device.type != "cuda":
        return refusal(q.device.type, q.dtype, q.shape[-1], None, False)
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return refusal("cuda", q.dtype, q.shape[-1], _capability(index), _built(),
                   rocm=torch.version.hip is not None)


def flash_op() -> FlashOp:
    """The op itself (looked up per call, so tests can stand in for it)."""
    return torch.ops.aten._flash_attention_forward


@dataclass(frozen=True)
class VarlenArgs:
    """The variable-length call's arguments for equal-length sequences.

    query (B * Tq, Hq, D), key/value (B * Tk, Hkv, D): views of the inputs where their layout
    allows (a copy otherwise; the last dim always has stride 1). cu_seq_q (B + 1,) and
    cu_seq_k (B + 1,) int32 offsets on the device; max_q = Tq, max_k = Tk (host ints from the
    shapes); window (left, right): (-1, 0) causal (bottom-right), (-1, -1) not; seqused_k
    (B,) int32 on the device or None (every key)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool
    window: tuple[int, int]
    seqused_k: torch.Tensor | None


def _rows(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1, *t.shape[2:])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def varlen_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                valid: torch.Tensor | None = None) -> VarlenArgs:
    """The call's arguments for q (B, Tq, Hq, D) over k/v (B, Tk, Hkv, D): every sequence's
    keys, or with ``valid`` (a (1,) or (B,) integer tensor on the device) only its first
    ``valid`` ones, causal counted from the last valid key. Only device ops (no host sync, no
    copy from the host): capturable."""
    b, tq = q.shape[:2]
    tk = k.shape[1]
    device = q.device
    cu_q = torch.arange(0, (b + 1) * tq, tq, dtype=torch.int32, device=device) if tq else \
        torch.zeros(b + 1, dtype=torch.int32, device=device)
    cu_k = torch.arange(0, (b + 1) * tk, tk, dtype=torch.int32, device=device) if tk else \
        torch.zeros(b + 1, dtype=torch.int32, device=device)
    used = None
    if valid is not None:
        used = valid.to(torch.int32).reshape(-1).expand(b).contiguous()
    return VarlenArgs(_rows(q), _rows(k), _rows(v), cu_q, cu_k, tq, tk, causal,
                      (-1, 0) if causal else (-1, -1), used)


def lse_to_bht(lse: torch.Tensor, batch: int, tq: int) -> torch.Tensor:
    """The variable-length call's lse (Hq, B * Tq), rows in the flattened order, as the
    project's (B, Hq, Tq) fp32."""
    hq = lse.shape[0]
    assert lse.shape == (hq, batch * tq), (lse.shape, batch, tq)
    return lse.float().view(hq, batch, tq).transpose(0, 1).contiguous()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
           valid: torch.Tensor | None = None,
           op: FlashOp | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of the kernel: q (B, Tq, Hq, D) over k/v (B, Tk, Hkv, D) (or their first
    ``valid`` keys, see :func:`varlen_args`), bottom-right causal when ``causal``.

    Every row must see at least one key (the kernel gives lse +inf to a row that sees none;
    :func:`apbv.attention.kernels.attention` never passes one). ``op`` defaults to
    :func:`flash_op`. Returns out (B, Tq, Hq, D) in q's dtype, lse (B, Hq, Tq) fp32."""
    b, tq, hq, d = q.shape
    args = varlen_args(q, k, v, causal, valid)
    result = (op or flash_op())(
        args.query, args.key, args.value, args.cu_seq_q, args.cu_seq_k, args.max_q,
        args.max_k, 0.0, args.causal, False, scale=scale, window_size_left=args.window[0],
        window_size_right=args.window[1], seqused_k=args.seqused_k)
    out, lse = result[0], result[1]
    return out.reshape(b, tq, hq, d), lse_to_bht(lse, b, tq)
