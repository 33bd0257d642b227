"""apbv.attention.kernels against fp64 ground truth, fp32 and bf16, every causal alignment.

Tolerance rule (flash-attention's): a kernel's error against fp64 truth may be at most twice the
error of a naive same-dtype implementation, plus a floor of a few fp32 ulps (1e-6) for sums
over up to a few hundred keys.
"""

from __future__ import annotations

import pytest
import torch

from apbv.attention import kernels

FLOOR = 1e-6


def truth(q, k, v, causal: bool, scale: float):
    """fp64 attention with a bottom-right causal mask; rows without keys: out 0, lse -inf."""
    group = q.shape[2] // k.shape[2]
    kd = k.double().repeat_interleave(group, dim=2)
    vd = v.double().repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kd) * scale
    if causal:
        tq, tk = q.shape[1], k.shape[1]
        s = s.masked_fill(~torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, vd), lse


def naive_same_dtype(q, k, v, causal: bool, scale: float):
    """Attention computed in the inputs' dtype (scores, probabilities and output rounded)."""
    group = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    if causal:
        tq, tk = q.shape[1], k.shape[1]
        s = s.masked_fill(~torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq), float("-inf"))
    lse = torch.logsumexp(s.float(), dim=-1)
    p = torch.softmax(s.float(), dim=-1).nan_to_num(0.0).to(q.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", p, vr), lse


def _inputs(tq, tk, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, tq, hq, d, generator=g).to(dtype)
    k = torch.randn(1, tk, hkv, d, generator=g).to(dtype)
    v = torch.randn(1, tk, hkv, d, generator=g).to(dtype)
    return q, k, v


def _finite_err(a, b) -> float:
    both_inf = torch.isinf(a) & torch.isinf(b) & (a.sign() == b.sign())
    return (a.double() - b.double()).masked_fill(both_inf, 0.0).abs().max().item()


def assert_matches_truth(out, lse, q, k, v, causal: bool, scale: float, label: str) -> None:
    """``out`` (B, Tq, Hq, D) and ``lse`` (B, Hq, Tq) of attention over CPU ``q, k, v``
    within twice the same-dtype naive implementation's error against fp64 :func:`truth`,
    plus :data:`FLOOR`; the assert message names ``label`` and the measured errors."""
    ref_out, ref_lse = truth(q, k, v, causal, scale)
    base_out, base_lse = naive_same_dtype(q, k, v, causal, scale)
    out_tol = 2 * _finite_err(base_out, ref_out) + FLOOR
    lse_tol = 2 * _finite_err(base_lse, ref_lse) + FLOOR
    out_err, lse_err = _finite_err(out.cpu(), ref_out), _finite_err(lse.cpu(), ref_lse)
    assert out_err <= out_tol, f"{label} out: max err {out_err:.2e} > tol {out_tol:.2e}"
    assert lse_err <= lse_tol, f"{label} lse: max err {lse_err:.2e} > tol {lse_tol:.2e}"


SHAPES = [  # (Tq, Tk, causal)
    (16, 16, True),
    (8, 40, True),  # fewer rows than keys: bottom-right alignment matters
    (40, 8, True),  # more rows than keys: the first 32 rows see nothing
    (13, 29, False),
    (1, 33, True),
]
HEADS = [(4, 4), (8, 2), (6, 2)]


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tq", "tk", "causal"), SHAPES)
@pytest.mark.parametrize(("hq", "hkv"), HEADS)
@pytest.mark.parametrize("d", [16, 64])
def test_kernel_matches_truth(backend, dtype, tq, tk, causal, hq, hkv, d):
    q, k, v = _inputs(tq, tk, hq, hkv, d, dtype)
    scale = d**-0.5
    out, lse = kernels.attention(q, k, v, causal=causal, scale=scale, backend=backend)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (1, hq, tq) and lse.dtype == torch.float32
    assert_matches_truth(out, lse, q, k, v, causal, scale, f"{backend} {dtype}")


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_rows_without_keys(backend):
    q, k, v = _inputs(6, 2, 4, 2, 8, torch.float32)
    out, lse = kernels.attention(q, k, v, causal=True, backend=backend)
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))
    assert torch.isneginf(lse[:, :, :4]).all() and torch.isfinite(lse[:, :, 4:]).all()
    for causal in (True, False):  # no keys at all (the CPU kernel would crash on Tk = 0)
        out, lse = kernels.attention(q, k[:, :0], v[:, :0], causal=causal, backend=backend)
        assert torch.equal(out, torch.zeros_like(q)) and torch.isneginf(lse).all()
    out, lse = kernels.attention(q[:, :0], k, v, causal=True, backend=backend)
    assert out.shape == (1, 0, 4, 8) and lse.shape == (1, 4, 0)


def test_default_backend_and_errors():
    q, k, v = _inputs(4, 4, 2, 2, 8, torch.float32)
    assert kernels.default_backend(q) == "sdpa"
    with pytest.raises(ValueError,
                       match="unknown attention backend 'triton'; allowed: flash, sdpa"):
        kernels.attention(q, k, v, causal=True, backend="triton")
    with pytest.raises(ValueError, match="backend 'flash' needs CUDA tensors and flash-attn"):
        kernels.attention(q, k, v, causal=True, backend="flash")


def test_gqa_does_not_repeat_kv_on_cpu(monkeypatch):
    """The CPU fused kernel gets the KV heads as they are (no repeat_interleave copy)."""
    seen = []
    real = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.shape[1], k.shape[1]))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", spy)
    q, k, v = _inputs(8, 8, 8, 2, 16, torch.float32)
    kernels.attention(q, k, v, causal=True, backend="sdpa")
    assert seen == [(8, 2)]
