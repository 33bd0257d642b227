"""GPU checks of torch's bundled flash kernel behind the adapter (skipped without CUDA, or
where apbv.attention.bundled_flash refuses the device, with the reason): the refusal against
torch's own check, out and lse against fp64 truth with GQA and bottom-right causal masks,
``seqused_k``, and the captured decode's owner attention in a CUDA graph against eager.

Tolerance rule as in tests/unit/test_kernels.py: at most twice the error of a naive same-dtype
implementation against fp64 truth, plus a small floor.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from apbv.attention import bundled_flash, kernels
from tests.unit.test_kernels import FLOOR, _finite_err, naive_same_dtype, truth

BF16_EPS = torch.finfo(torch.bfloat16).eps


def _why_not() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    probe = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16, device="cuda")
    why = bundled_flash.refusal_for(probe)
    return None if why is None else f"torch's bundled flash kernel is refused here: {why}"


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
needs_kernel = pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))


def _inputs(b, tq, tk, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, t, h, d, generator=g).to("cuda", dtype)
                 for t, h in ((tq, hq), (tk, hkv), (tk, hkv)))


def _check(out, lse, q, k, v, causal, scale, what):
    cpu = [t.cpu() for t in (q, k, v)]
    ref_out, ref_lse = truth(*cpu, causal, scale)
    base_out, base_lse = naive_same_dtype(*cpu, causal, scale)
    out_tol = 2 * _finite_err(base_out, ref_out) + FLOOR
    lse_tol = 2 * _finite_err(base_lse, ref_lse) + FLOOR
    out_err, lse_err = _finite_err(out.cpu(), ref_out), _finite_err(lse.cpu(), ref_lse)
    assert out_err <= out_tol, f"{what}: out err {out_err:.2e} > {out_tol:.2e}"
    assert lse_err <= lse_tol, f"{what}: lse err {lse_err:.2e} > {lse_tol:.2e}"


@pytest.fixture
def op_calls(monkeypatch):
    """The real op, counted."""
    calls = []
    real = torch.ops.aten._flash_attention_forward

    def counted(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(bundled_flash, "flash_op", lambda: counted)
    return calls


@pytest.mark.parametrize(("dtype", "d"), [(torch.bfloat16, 128), (torch.float16, 64),
                                          (torch.float32, 128), (torch.bfloat16, 512)])
def test_refusal_agrees_with_torchs_own_flash_check(dtype, d):
    """Where torch's SDPA dispatcher would take its flash kernel for these (B, H, T, D)
    tensors, the adapter's refusal is None, and the other way round."""
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    q = torch.empty(1, 8, 64, d, dtype=dtype, device="cuda")
    torchs = bool(can_use_flash_attention(SDPAParams(q, q, q, None, 0.0, True, False), False))
    ours = bundled_flash.refusal_for(q.transpose(1, 2))
    assert torchs == (ours is None), (f"{dtype} D={d} on compute capability "
                                      f"{torch.cuda.get_device_capability()}: torch says "
                                      f"{torchs}, the adapter {ours!r}")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("tq", "tk", "causal"), [(128, 128, True), (64, 300, True),
                                                  (1, 300, True), (77, 129, False)])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(8, 8, 128), (28, 4, 128), (16, 2, 64)])
def test_sdpa_backend_is_one_bundled_call_matching_truth(op_calls, dtype, tq, tk, causal, hq,
                                                         hkv, d):
    """kernels.attention's sdpa backend on CUDA: one call of the bundled kernel (GQA native,
    bottom-right causal with fewer rows than keys), two sequences, out and lse (B, Hq, Tq)
    against fp64 truth."""
    q, k, v = _inputs(2, tq, tk, hq, hkv, d, dtype)
    scale = d**-0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        out, lse = kernels.attention(q, k, v, causal=causal, scale=scale, backend="sdpa")
    assert op_calls == [(2 * tq, hq, d)], op_calls
    assert out.shape == q.shape and lse.shape == (2, hq, tq) and lse.dtype == torch.float32
    _check(out, lse, q, k, v, causal, scale, f"{dtype} {tq}x{tk} causal={causal} {hq}/{hkv}")


@needs_kernel
@pytest.mark.parametrize(("tq", "causal"), [(1, False), (5, True)])
def test_seqused_k_reads_only_the_valid_keys(tq, causal):
    """Two sequences over one buffer of 300 rows with 37 and 300 valid keys (the rest large
    values that would show): each against truth over its valid keys, causal counted from its
    last valid key."""
    q, k, v = _inputs(2, tq, 300, 28, 4, 128, torch.bfloat16, seed=1)
    k[0, 37:], v[0, 37:] = 30.0, -30.0
    valid = torch.tensor([37, 300], device="cuda")
    out, lse = bundled_flash.attend(q, k, v, causal=causal, scale=0.1, valid=valid)
    for b, n in enumerate((37, 300)):
        _check(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n],
               causal, 0.1, f"sequence {b}, {n} valid keys")


@needs_kernel
def test_owner_attention_in_a_cuda_graph_equals_eager(op_calls):
    """The captured decode's owner attention (kernels.attention_upto over a 4096-row buffer
    with the valid length on the device) captured once and replayed for other lengths and
    queries: equal to the eager call, within one bf16 rounding of the output, and to the fp32
    einsum within the bf16 rule; the capture holds one bundled call and no host sync (a
    sync fails a capture)."""
    q, k, v = _inputs(1, 1, 4096, 28, 4, 128, torch.bfloat16, seed=2)
    length = torch.tensor([100], device="cuda")
    kernels.attention_upto(q, k, v, length, 0.088)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # on its own side stream
        out, lse = kernels.attention_upto(q, k, v, length, 0.088)
    assert len(op_calls) == 2, op_calls
    g = torch.Generator(device="cuda").manual_seed(3)
    for n in (1, 100, 2047, 4096):
        q.copy_(torch.randn(q.shape, generator=g, device="cuda"))
        length.fill_(n)
        graph.replay()
        eager_out, eager_lse = kernels.attention_upto(q, k, v, length, 0.088)
        einsum_out, einsum_lse = kernels.attention_upto_einsum(q, k, v, length, 0.088)
        size = max(1.0, eager_out.float().abs().max().item())
        lse_size = max(1.0, eager_lse.abs().max().item())
        err = (out.float() - eager_out.float()).abs().max().item()
        lse_err = (lse - eager_lse).abs().max().item()
        assert err <= BF16_EPS * size and lse_err <= 1e-5 * lse_size, \
            f"{n} valid: graph vs eager out {err:.2e} (tol {BF16_EPS * size:.2e}), " \
            f"lse {lse_err:.2e}"
        err = (out.float() - einsum_out.float()).abs().max().item()
        lse_err = (lse - einsum_lse).abs().max().item()
        assert err <= 2 * BF16_EPS * size and lse_err <= 1e-4 * lse_size, \
            f"{n} valid: graph vs fp32 einsum out {err:.2e}, lse {lse_err:.2e}"


def test_fp32_on_cuda_falls_back_with_the_reason():
    q, k, v = _inputs(1, 16, 40, 8, 2, 64, torch.float32)
    with pytest.warns(UserWarning, match="dtype float32: the kernel takes float16 or bfloat16"):
        kernels._warn_sdpa_fallback.cache_clear()
        out, lse = kernels.attention(q, k, v, causal=True, scale=0.125, backend="sdpa")
    _check(out, lse, q, k, v, True, 0.125, "fp32 fallback")
