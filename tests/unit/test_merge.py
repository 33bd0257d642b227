"""apbv.attention.merge against a direct fp64 logsumexp reference."""

from __future__ import annotations

import itertools

import torch

from apbv.attention import kernels
from apbv.attention.merge import merge_into, merge_partials

FP32_TOL = 1e-6  # one fp32 merge of O(1) outputs: a few ulps


def reference_merge(outs, lses):
    """The obvious formula in fp64: weights exp(lse_i - logsumexp(lse)), zero for -inf."""
    lse_stack = torch.stack([x.double() for x in lses])  # (S, B, H, T)
    total = torch.logsumexp(lse_stack, dim=0)
    weights = torch.exp(lse_stack - total).nan_to_num(0.0)  # (S, B, H, T)
    out = sum(w.transpose(1, 2).unsqueeze(-1) * o.double() for w, o in zip(weights, outs))
    return out, total


def _partials(cuts, seed=0, tq=7, hq=4, hkv=2, d=16, scale=1.0):
    """Non-causal partials of q over the key ranges between ``cuts`` (a range may be empty)."""
    g = torch.Generator().manual_seed(seed)
    tk = cuts[-1]
    q = torch.randn(1, tq, hq, d, generator=g) * scale
    k = torch.randn(1, tk, hkv, d, generator=g)
    v = torch.randn(1, tk, hkv, d, generator=g)
    parts = [kernels.attention(q, k[:, a:b], v[:, a:b], causal=False)
             for a, b in zip(cuts, cuts[1:])]
    full = kernels.attention(q, k, v, causal=False, backend="reference")
    return parts, full


def test_merge_equals_attention_over_all_keys():
    parts, (full_out, full_lse) = _partials([0, 5, 5, 17, 30])  # includes an empty partial
    assert torch.isneginf(parts[1][1]).all()
    out, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    err = (out - full_out).abs().max().item()
    assert err <= FP32_TOL, f"merged out vs full attention: max err {err:.2e}"
    ref_out, ref_lse = reference_merge([p[0] for p in parts], [p[1] for p in parts])
    assert (out.double() - ref_out).abs().max().item() <= FP32_TOL
    assert (lse.double() - ref_lse).abs().max().item() <= FP32_TOL


def test_merge_order_does_not_matter():
    parts, _ = _partials([0, 3, 3, 11, 12, 25], seed=1)
    results = []
    for order in itertools.permutations(range(len(parts))):
        results.append(merge_partials([parts[i][0] for i in order], [parts[i][1] for i in order]))
    for out, lse in results[1:]:
        out_err = (out - results[0][0]).abs().max().item()
        lse_err = (lse - results[0][1]).abs().max().item()
        assert out_err <= FP32_TOL and lse_err <= FP32_TOL, (out_err, lse_err)


def test_no_keys_anywhere_stays_empty_without_nan():
    zeros = torch.zeros(1, 3, 2, 4)
    ninf = torch.full((1, 2, 3), float("-inf"))
    out, lse = merge_partials([zeros, zeros.clone()], [ninf, ninf.clone()])
    assert torch.equal(out, zeros) and torch.isneginf(lse).all()
    # An empty accumulator folded with a real partial becomes that partial.
    real = torch.randn(1, 3, 2, 4)
    real_lse = torch.randn(1, 2, 3)
    out, lse = merge_into(zeros, ninf, real, real_lse)
    assert torch.equal(out, real) and torch.equal(lse, real_lse)


def test_large_logits_do_not_overflow():
    """lse in the thousands: exp(lse) overflows fp32, the stable form must not."""
    parts, (_, full_lse) = _partials([0, 9, 20], seed=2, scale=300.0)
    assert full_lse.abs().max() > 500
    outs, lses = [p[0] for p in parts], [p[1] for p in parts]
    assert not torch.isfinite(torch.exp(lses[0])).all()  # the plain form would overflow
    out, lse = merge_partials(outs, lses)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref_out, ref_lse = reference_merge(outs, lses)
    err = (out.double() - ref_out).abs().max().item()
    lse_err = ((lse.double() - ref_lse).abs() / ref_lse.abs()).max().item()
    assert err <= FP32_TOL, f"out max err {err:.2e} vs fp64 merge"
    assert lse_err <= FP32_TOL, f"lse relative err {lse_err:.2e} vs fp64 merge"


def test_bf16_partials_merge_in_fp32():
    parts, (full_out, _) = _partials([0, 10, 21], seed=3)
    out, _ = merge_partials([p[0].bfloat16() for p in parts], [p[1] for p in parts])
    assert out.dtype == torch.float32
    # Inputs rounded to bf16 (relative 2^-9); the merge adds only fp32 rounding on top.
    err = (out - full_out).abs().max().item()
    bound = 2 * max((p[0].bfloat16().float() - p[0]).abs().max().item() for p in parts) + 1e-6
    assert err <= bound, f"max err {err:.2e} > {bound:.2e}"
