"""apbv/attention/bundled_flash.py on the CPU: when torch's bundled flash kernel is refused, the
arguments it gets, how its lse is read, and the whole call through a plain-math stand-in with
the op's contract (tests/flash_standin.py), against fp64 truth and the einsum owner path. The
real op's shapes and keyword names are checked on meta tensors (torch's meta kernel).

Tolerance rule as in tests/unit/test_kernels.py: at most twice the error of a naive same-dtype
implementation against fp64 truth, plus a floor.
"""

from __future__ import annotations

import pytest
import torch

from apbv.attention import bundled_flash, kernels
from tests.flash_standin import flash_forward
from tests.unit.test_kernels import HEADS, SHAPES, assert_matches_truth

BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2**-8: one rounding of a bf16 output
FP32_TOL = 1e-5  # two fp32 evaluations of one softmax over <= 64 keys


def _inputs(b, tq, tk, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, tq, hq, d, generator=g).to(dtype),
            torch.randn(b, tk, hkv, d, generator=g).to(dtype),
            torch.randn(b, tk, hkv, d, generator=g).to(dtype))


@pytest.mark.parametrize(("args", "reason"), [
    (("cuda", torch.bfloat16, 128, (9, 0), True), None),
    (("cuda", torch.float16, 64, (8, 0), True), None),
    (("cuda", torch.bfloat16, 256, (12, 1), True), None),
    (("cpu", torch.bfloat16, 128, None, True), "on cpu, the kernel runs on CUDA only"),
    (("cuda", torch.float32, 128, (9, 0), True),
     "dtype float32: the kernel takes float16 or bfloat16"),
    (("cuda", torch.bfloat16, 264, (9, 0), True), "head dim 264: the kernel takes at most 256"),
    (("cuda", torch.bfloat16, 100, (9, 0), True), "head dim 100: .* a multiple of 8"),
    (("cuda", torch.bfloat16, 128, (7, 5), True),
     r"compute capability 7.5: the kernel runs on 8.0 to 12.1"),
    (("cuda", torch.bfloat16, 128, (13, 0), True), "compute capability 13.0"),
    (("cuda", torch.bfloat16, 128, (9, 0), False), "built without its flash attention kernel"),
])
def test_refusal_names_the_limit(args, reason):
    got = bundled_flash.refusal(*args)
    if reason is None:
        assert got is None, got
    else:
        assert got is not None and __import__("re").search(reason, got), (got, reason)


def test_rocm_is_refused():
    assert "ROCm" in bundled_flash.refusal("cuda", torch.bfloat16, 128, (9, 4), True, rocm=True)


def test_varlen_args_offsets_window_and_valid_length():
    q, k, v = _inputs(2, 3, 5, 4, 2, 8, torch.bfloat16)
    args = bundled_flash.varlen_args(q, k, v, causal=True)
    assert args.cu_seq_q.tolist() == [0, 3, 6] and args.cu_seq_k.tolist() == [0, 5, 10]
    assert args.cu_seq_q.dtype == args.cu_seq_k.dtype == torch.int32
    assert (args.max_q, args.max_k, args.causal, args.window) == (3, 5, True, (-1, 0))
    assert args.query.shape == (6, 4, 8) and args.key.shape == (10, 2, 8)
    assert args.query.data_ptr() == q.data_ptr() and args.key.data_ptr() == k.data_ptr()
    assert args.seqused_k is None
    plain = bundled_flash.varlen_args(q, k, v, causal=False, valid=torch.tensor([4]))
    assert plain.window == (-1, -1) and plain.seqused_k is not None
    assert plain.seqused_k.dtype == torch.int32 and plain.seqused_k.tolist() == [4, 4]
    each = bundled_flash.varlen_args(q, k, v, causal=False, valid=torch.tensor([1, 5]))
    assert each.seqused_k is not None and each.seqused_k.tolist() == [1, 5]
    # a layout that cannot be flattened to rows: copied, with stride 1 along D
    odd = q.transpose(1, 2).contiguous().transpose(1, 2)
    flat = bundled_flash.varlen_args(odd, k, v, causal=True).query
    assert flat.stride(-1) == 1 and torch.equal(flat, q.reshape(6, 4, 8))


def test_lse_layout_becomes_b_h_t():
    b, hq, tq = 3, 4, 5
    h, bb, t = torch.meshgrid(torch.arange(hq), torch.arange(b), torch.arange(tq), indexing="ij")
    flat = (100 * h + 10 * bb + t).float().reshape(hq, b * tq)  # rows in (b, t) order
    got = bundled_flash.lse_to_bht(flat, b, tq)
    want = torch.tensor([[[100 * hh + 10 * x + tt for tt in range(tq)] for hh in range(hq)]
                         for x in range(b)], dtype=torch.float32)
    assert got.shape == (b, hq, tq) and got.dtype == torch.float32 and torch.equal(got, want)


@pytest.fixture
def standin(monkeypatch):
    """kernels.attention's sdpa backend on the CPU as on a CUDA device that takes the bundled
    kernel, with the stand-in as the op; yields the list of the op's calls."""
    calls = []

    def op(*args, **kwargs):
        calls.append(args[0].shape)
        return flash_forward(*args, **kwargs)

    monkeypatch.setattr(bundled_flash, "refusal_for", lambda q: None)
    monkeypatch.setattr(bundled_flash, "flash_op", lambda: op)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tq", "tk", "causal"), SHAPES)
@pytest.mark.parametrize(("hq", "hkv"), HEADS)
def test_sdpa_backend_through_the_op_matches_truth(standin, dtype, tq, tk, causal, hq, hkv):
    """One op call per attention call (GQA native, bottom-right causal in the kernel: no
    per-group calls, no prefix split), out and lse (B, Hq, Tq) right for two sequences."""
    q, k, v = _inputs(2, tq, tk, hq, hkv, 16, dtype)
    scale = 16**-0.5
    out, lse = kernels.attention(q, k, v, causal=causal, scale=scale, backend="sdpa")
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, hq, tq) and lse.dtype == torch.float32
    sees_keys = tq - max(0, tq - tk) if causal else tq  # rows that see a key reach the op
    assert standin == [(2 * sees_keys, hq, 16)], standin
    assert_matches_truth(out, lse, q, k, v, causal, scale, str(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_owner_attention_with_a_valid_length_matches_the_einsum(standin, dtype):
    """The captured decode's owner attention (kernels.attention_upto through the op with
    seqused_k) against the fp32 einsum over the whole buffer, for valid lengths from one key
    to the whole buffer; the rows past the valid length hold large values that would show."""
    q, k, v = _inputs(1, 1, 40, 28, 4, 16, dtype, seed=3)
    k[:, 20:], v[:, 20:] = 50.0, -50.0
    for valid in (1, 7, 20):
        length = torch.tensor([valid])
        got_out, got_lse = kernels.attention_upto(q, k, v, length, 0.25)
        want_out, want_lse = kernels.attention_upto_einsum(q, k, v, length, 0.25)
        out_err = (got_out.float() - want_out.float()).abs().max().item()
        lse_err = (got_lse - want_lse).abs().max().item()
        size = max(1.0, want_out.float().abs().max().item())
        out_tol = (FP32_TOL if dtype == torch.float32 else BF16_EPS) * size
        assert out_err <= out_tol, f"{dtype} valid {valid}: out err {out_err:.2e} > {out_tol:.2e}"
        lse_tol = FP32_TOL * max(1.0, want_lse.abs().max().item())
        assert lse_err <= lse_tol, f"{dtype} valid {valid}: lse err {lse_err:.2e} > {lse_tol:.2e}"
    assert len(standin) == 3


def test_real_op_shapes_and_keywords_on_meta_tensors():
    """The aten op itself (its meta kernel) takes the call as attend() makes it, with no
    value read back on the host (meta tensors have none), and the stand-in returns what it
    returns: out (total_q, Hq, D), lse (Hq, total_q) fp32."""
    b, tq, tk, hq, hkv, d = 2, 3, 11, 8, 2, 128
    meta = [torch.empty(s, dtype=torch.bfloat16, device="meta")
            for s in ((b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, d))]
    valid = torch.empty(1, dtype=torch.long, device="meta")
    out, lse = bundled_flash.attend(*meta, causal=False, scale=0.1, valid=valid)
    assert out.shape == (b, tq, hq, d) and out.dtype == torch.bfloat16
    assert lse.shape == (b, hq, tq) and lse.dtype == torch.float32
    real_args = bundled_flash.varlen_args(*meta, causal=True, valid=valid)
    cpu = _inputs(b, tq, tk, hq, hkv, d, torch.bfloat16)
    cpu_args = bundled_flash.varlen_args(*cpu, causal=True, valid=torch.tensor([5]))
    results = []
    for op, a in ((torch.ops.aten._flash_attention_forward, real_args),
                  (flash_forward, cpu_args)):
        results.append(op(a.query, a.key, a.value, a.cu_seq_q, a.cu_seq_k, a.max_q, a.max_k,
                          0.0, a.causal, False, scale=0.1, window_size_left=a.window[0],
                          window_size_right=a.window[1], seqused_k=a.seqused_k))
    for real, stand in zip(results[0][:2], results[1][:2], strict=True):
        assert (real.shape, real.dtype) == (stand.shape, stand.dtype), (real.shape, stand.shape)
    assert results[0][1].shape == (hq, b * tq)


def test_cpu_tensors_keep_the_cpu_kernel(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the bundled flash op was called for CPU tensors")

    monkeypatch.setattr(bundled_flash, "flash_op", lambda: refuse)
    q, k, v = _inputs(1, 4, 9, 4, 2, 16, torch.float32)
    assert "on cpu" in (bundled_flash.refusal_for(q) or "")
    kernels.attention(q, k, v, causal=True, backend="sdpa")
    kernels.attention_upto(q, k, v, torch.tensor([3]), 0.25)


def test_kernel_benchmark_dry_run(capsys):
    """benchmarks/bench_kernels.py at toy sizes on the CPU: every row, the refusal named, no
    ratio claimed (both columns time the same fallback there)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--dry-run", "--calls", "1", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "bundled kernel: the tensors are on cpu" in lines[0], lines[0]
    table = [line for line in lines if line.startswith("| attention") or
             line.startswith("| owner")]
    assert len(table) == 7 and all(line.endswith("| - |") for line in table), table
