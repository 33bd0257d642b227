"""GPU checks (skipped without CUDA): the CUDA kernel paths and the op in bf16 on one device.

Tolerances follow tests/unit/test_kernels.py: at most twice the error of a naive same-dtype
implementation against fp64 truth, plus a small floor.
"""

from __future__ import annotations

import pytest
import torch

from apbv import apbv_attention
from apbv.attention import kernels
from apbv.layout import shard
from tests.cases import Case, check
from tests.unit.test_kernels import FLOOR, _finite_err, naive_same_dtype, truth

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BACKENDS = ["sdpa", pytest.param("flash", marks=pytest.mark.skipif(
    not kernels.flash_available(), reason="flash-attn is not installed"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("tq", "tk", "causal"), [(128, 128, True), (64, 300, True),
                                                  (300, 64, True), (77, 129, False)])
@pytest.mark.parametrize(("hq", "hkv"), [(8, 8), (16, 2)])
def test_cuda_kernels_match_truth(backend, dtype, tq, tk, causal, hq, hkv):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, tq, hq, 128, generator=g).to("cuda", dtype)
    k = torch.randn(1, tk, hkv, 128, generator=g).to("cuda", dtype)
    v = torch.randn(1, tk, hkv, 128, generator=g).to("cuda", dtype)
    scale = 128**-0.5
    out, lse = kernels.attention(q, k, v, causal=causal, scale=scale, backend=backend)
    cpu = [t.cpu() for t in (q, k, v)]
    ref_out, ref_lse = truth(*cpu, causal, scale)
    base_out, base_lse = naive_same_dtype(*cpu, causal, scale)
    out_tol = 2 * _finite_err(base_out, ref_out) + FLOOR
    lse_tol = 2 * _finite_err(base_lse, ref_lse) + FLOOR
    out_err = _finite_err(out.cpu(), ref_out)
    lse_err = _finite_err(lse.cpu(), ref_lse)
    assert out_err <= out_tol, f"{backend} {dtype}: out err {out_err:.2e} > {out_tol:.2e}"
    assert lse_err <= lse_tol, f"{backend} {dtype}: lse err {lse_err:.2e} > {lse_tol:.2e}"


@pytest.mark.parametrize("mode", ["spava", "exact"])
def test_op_bf16_on_cuda_matches_oracle(mode):
    case = Case(600, 12, anchor_len=16, passing_len=24, heads=8, kv_heads=2, head_dim=64,
                mode=mode, dtype="bfloat16", seed=5)
    plan = case.plan(1)
    q, k, v = (shard(t, plan, 0).cuda() for t in case.inputs())
    out = apbv_attention(q, k, v, plan, overlap=case.overlap)
    problem = check(case, plan, out.cpu())
    assert problem is None, problem


def test_grouped_vision_tower_on_cuda_matches_the_stock_tower() -> None:
    """The vision tower in bf16 on CUDA: grouped (one varlen call per block) against the
    stock per-window SDPA path, on frames with edge windows; bf16 rounding differs between
    the kernels, so the bound is loose (1e-1 on activations of order 1)."""
    from apbv.model import qwen2_5_vl
    from apbv.model.tiny import build_tiny_model

    model = build_tiny_model().to("cuda", torch.bfloat16).eval()
    grid = torch.tensor([[2, 12, 20]], device="cuda")
    pixels = torch.randn(2 * 12 * 20, 3 * 2 * 14 * 14, device="cuda", dtype=torch.bfloat16)
    outs = []
    with torch.inference_mode():
        for name in ("per_window", "grouped"):
            qwen2_5_vl.set_vision_attention(model, name)
            out = model.model.visual(pixels, grid_thw=grid)
            outs.append((out if isinstance(out, torch.Tensor) else out.pooler_output).float())
    error = (outs[0] - outs[1]).abs().max().item()
    assert error <= 1e-1, error


def test_in_rank_pipeline_on_cuda_matches_rows_then_tower(tmp_path) -> None:
    """vision.pipeline on CUDA: patch rows made on the host in a worker thread while the
    device runs the tower on the previous chunk; the same embeddings as rows-then-tower (bf16:
    the tower's kernels see smaller batches, so the bound is loose, 5e-2 of the scale)."""
    from apbv.model import qwen2_5_vl
    from apbv.model.tiny import write_tiny_checkpoint

    qwen = qwen2_5_vl.load(write_tiny_checkpoint(tmp_path / "tiny"), device=torch.device("cuda"),
                           dtype=torch.bfloat16)
    assert qwen.chunk_rows == 0  # one tower call per video on GPUs
    frames = torch.randint(0, 256, (16, 3, 112, 224), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        whole = qwen.vision_tower(*qwen.process_frames(frames)).float()
        piped = qwen.encode_frames(frames.split(4)).float()
    error, scale = (piped - whole).abs().max().item(), whole.abs().max().item()
    assert piped.shape == whole.shape and error <= 5e-2 * scale, (error, scale)
