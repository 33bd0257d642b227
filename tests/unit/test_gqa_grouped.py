"""Grouped-query attention without copying K/V (the CUDA SDPA path's :func:`grouped`).

PyTorch's CUDA kernels that return the log-sum-exp need as many query heads as KV heads; the
adapter used to repeat K and V for them (7x the keys read per call on a 28/4-head model).
:func:`grouped` instead folds the query group into rows, or calls once per group member
when causal. Its logic is device-independent, so it is checked here on the CPU through the
CPU fused kernel restricted to equal head counts, against the old repeat path and the fp32
reference (fp32, max abs error <= 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from apbv.attention import kernels

TOL = 1e-5  # fp32: the same sums in another order


def _equal_heads(calls: list) -> kernels.EqualHeadsKernel:
    """The CPU fused kernel on (B, H, T, D) with as many query as KV heads, recording the
    K/V it is handed."""

    def kernel(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, causal: bool):
        assert qh.shape[1] == kh.shape[1], (qh.shape, kh.shape)
        calls.append((kh, vh))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qh, kh, vh, 0.0, causal, scale=qh.shape[-1] ** -0.5)
        return out, lse

    return kernel


@pytest.mark.parametrize(("tq", "tk", "causal"),
                         [(1, 37, False), (5, 37, False), (23, 23, True), (1, 1, True)])
@pytest.mark.parametrize(("hq", "hkv"), [(28, 4), (6, 2), (4, 4)])
def test_grouped_equals_the_repeat_path_without_copying_kv(
        tq: int, tk: int, causal: bool, hq: int, hkv: int) -> None:
    torch.manual_seed(tq * 100 + hq)
    d = 16
    qh = torch.randn(1, hq, tq, d)
    kh, vh = torch.randn(1, hkv, tk, d), torch.randn(1, hkv, tk, d)
    calls: list = []
    out, lse = kernels.grouped(qh, kh, vh, causal, _equal_heads(calls))
    group = hq // hkv
    old_out, old_lse = _equal_heads([])(qh, kh.repeat_interleave(group, dim=1),
                                        vh.repeat_interleave(group, dim=1), causal)
    assert out.shape == (1, hq, tq, d) and lse.shape == (1, hq, tq)
    assert (out - old_out).abs().max().item() <= TOL
    assert (lse - old_lse).abs().max().item() <= TOL
    ref_out, ref_lse = kernels.attention(qh.transpose(1, 2), kh.transpose(1, 2),
                                         vh.transpose(1, 2), causal=causal, backend="reference")
    assert (out.transpose(1, 2) - ref_out).abs().max().item() <= TOL
    assert (lse - ref_lse).abs().max().item() <= TOL
    # K and V go to the kernel as they are: no repeated copy, one call unless causal.
    assert len(calls) == (group if causal and group > 1 else 1)
    for k_arg, v_arg in calls:
        assert k_arg.data_ptr() == kh.data_ptr() and k_arg.shape == kh.shape
        assert v_arg.data_ptr() == vh.data_ptr() and v_arg.shape == vh.shape


def test_a_causal_decode_row_is_one_unmasked_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """One bottom-right causal row sees every key: the adapter makes it one kernel call (not
    a prefix and a 1x1 square merged), with the same result as the reference."""
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 1, 28, 16), torch.randn(1, 40, 4, 16), torch.randn(1, 40, 4, 16)
    calls = []
    original = kernels._sdpa

    def counted(*args):
        calls.append(args[3])  # causal
        return original(*args)

    monkeypatch.setattr(kernels, "_sdpa", counted)
    out, lse = kernels.attention(q, k, v, causal=True, backend="sdpa")
    assert calls == [False]
    ref_out, ref_lse = kernels.attention(q, k, v, causal=True, backend="reference")
    assert (out - ref_out).abs().max().item() <= TOL
    assert (lse - ref_lse).abs().max().item() <= TOL
