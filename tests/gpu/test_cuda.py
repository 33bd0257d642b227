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


def test_vision_tower_on_cuda_matches_the_stock_tower() -> None:
    """The runtime's vision tower on CUDA (grouped attention: one varlen call per block in
    bf16; linear patch embedding; fused rotary and RMSNorm; the MLP padded, 64 -> 96 here)
    and transformers' stock tower, on frames with edge windows, each against the fp32 stock
    tower on the same device: in bf16 the runtime's error may be at most twice the stock
    one's (the kernel tests' rule; outputs near 100, where one bf16 ulp is 0.5); in fp32 the
    two towers agree within 1e-5 of the scale."""
    from apbv.config import VisionConfig
    from apbv.model.common import tower
    from apbv.model.qwen2_5_vl.tiny import build_tiny_model

    towers = {"stock": VisionConfig(attention="per_window", patch_embed="conv", rotary="stock",
                                    norm="stock", mlp_pad=0),
              "runtime": VisionConfig(mlp_pad=48)}
    grid = torch.tensor([[2, 12, 20]], device="cuda")
    pixels = torch.randn(2 * 12 * 20, 3 * 2 * 14 * 14, device="cuda",
                         generator=torch.Generator("cuda").manual_seed(0))
    outs = {}
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:  # fp32 is fp32: cuDNN's convolutions would take TF32 by default
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        with torch.inference_mode():
            for dtype in (torch.float32, torch.bfloat16):
                model = build_tiny_model().to("cuda", dtype).eval()
                for name, vision in towers.items():
                    tower.set_tower(model, vision, torch.device("cuda"))
                    out = model.model.visual(pixels.to(dtype), grid_thw=grid)
                    outs[name, dtype] = (out if isinstance(out, torch.Tensor)
                                         else out.pooler_output).float()
    finally:
        tower.set_vision_rotary("fused")
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    truth = outs["stock", torch.float32]
    scale = truth.abs().max().item()
    fp32 = (outs["runtime", torch.float32] - truth).abs().max().item()
    assert fp32 <= 1e-5 * scale, f"fp32: runtime vs stock {fp32:.2e} at scale {scale:.1f}"
    stock, runtime = ((outs[name, torch.bfloat16] - truth).abs().max().item()
                      for name in ("stock", "runtime"))
    print(f"bf16 vs the fp32 tower: stock {stock:.3g}, runtime {runtime:.3g} (scale {scale:.1f})")
    assert runtime <= 2 * stock, (f"bf16 error vs the fp32 tower: runtime {runtime:.3g} > "
                                  f"2 x stock {stock:.3g} (scale {scale:.1f})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_rotary_on_cuda_is_bit_equal_to_the_stock_one(dtype) -> None:
    """The fused q/k rotary gives transformers' bits on CUDA too (the same products and sums,
    each in its own kernel), for q and k cut out of one qkv product, in order and reversed."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as modeling

    from apbv.model.common.vision_attention import fused_rotary

    stock = getattr(modeling.apply_rotary_pos_emb_vision, "stock",
                    modeling.apply_rotary_pos_emb_vision)
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(300, 3, 16, 80, generator=g).to("cuda", dtype).permute(1, 0, 2, 3)
    cos, sin = torch.randn(2, 300, 80, generator=g).cuda()
    for q, k in ((qkv[0], qkv[1]), (qkv[1], qkv[0])):
        for got, want in zip(fused_rotary(stock)(q, k, cos, sin), stock(q, k, cos, sin)):
            assert got.dtype == want.dtype == dtype
            assert torch.equal(got, want), (got.float() - want.float()).abs().max().item()


def test_in_rank_pipeline_on_cuda_matches_rows_then_tower(tmp_path) -> None:
    """vision.pipeline on CUDA: patch rows made on the host in a worker thread while the
    device runs the tower on the previous chunk; the same embeddings as rows-then-tower (bf16:
    the tower's kernels see smaller batches, so the bound is loose, 5e-2 of the scale)."""
    from apbv.model.qwen2_5_vl import adapter as qwen2_5_vl
    from apbv.model.qwen2_5_vl.tiny import write_tiny_checkpoint

    model = qwen2_5_vl.load(write_tiny_checkpoint(tmp_path / "tiny"), device=torch.device("cuda"),
                            dtype=torch.bfloat16)
    assert model.chunk_rows == 0  # one tower call per video on GPUs
    frames = torch.randint(0, 256, (16, 3, 112, 224), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        whole = model.vision_tower(*model.process_frames(frames)).float()
        piped = model.encode_frames(frames.split(4)).float()
    error, scale = (piped - whole).abs().max().item(), whole.abs().max().item()
    assert piped.shape == whole.shape and error <= 5e-2 * scale, (error, scale)


def _needle_run(device: str, dtype: str) -> dict[str, dict]:
    """The demo's rank job (:func:`apbv.cli.demo_pipeline._rank_job`) on one rank of ``device``: the
    trained tiny checkpoint asked about the held-out needle video in spava and in exact mode (frames
    made in memory, no decoder)."""
    from apbv.assets import needle_tiny
    from apbv.cli.demo_pipeline import DEMO_MODES, _rank_job, needle_sample
    from apbv.config import load_config
    from apbv.distributed import DistInfo

    cfg = load_config("tiny_cpu", [f"model.path={str(needle_tiny())!r}",
                                   f"model.dtype={dtype!r}"])
    info = DistInfo(0, 1, 0, torch.device(device), None)
    return dict(zip(DEMO_MODES, _rank_job(info, cfg, None, needle_sample().question)))


def test_engine_on_one_cuda_rank_answers_as_on_the_cpu() -> None:
    """The whole request path on a CUDA rank (patch rows from the pixel levels on the device,
    the grouped tower with one varlen call per block, the APB-V op, decoding): in fp32 exact
    mode gives the CPU's tokens, and the answer is the needle's colour in fp32 and in bf16
    (the GPU default), in spava as in exact."""
    from apbv.cli.demo_pipeline import needle_sample

    right = needle_sample().answer
    cpu = _needle_run("cpu", "float32")["exact"]
    assert cpu["answer"].strip() == right, cpu["answer"]
    for dtype in ("float32", "bfloat16"):
        runs = _needle_run("cuda", dtype)
        print(f"cuda {dtype}:", {m: (r["answer"], r["token_ids"], round(r["ttft_s"], 4))
                                 for m, r in runs.items()})
        for mode, run in runs.items():
            assert run["answer"].strip() == right, (dtype, mode, run["answer"])
        if dtype == "float32":
            assert runs["exact"]["token_ids"] == cpu["token_ids"], (runs["exact"], cpu)


@pytest.mark.skipif(not kernels.flash_available(), reason="flash-attn is not installed")
def test_flash_attn_interface_returns_the_lse_the_adapter_reads():
    """The installed flash-attn (FA3's ``flash_attn_interface`` or FA2's ``flash_attn``) still
    has the call the adapter makes: ``flash_attn_func(q, k, v, softmax_scale=, causal=,
    return_attn_probs=True)`` returning the output (B, T, H, D) first and the log-sum-exp
    (B, H, T) second, as the adapter reads them."""
    module = kernels._flash_module()
    version = getattr(module, "__version__", "unknown")
    q = torch.randn(2, 96, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 80, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    result = module.flash_attn_func(q, k, v, softmax_scale=64**-0.5, causal=True,
                                    return_attn_probs=True)
    assert isinstance(result, tuple) and len(result) >= 2, (module.__name__, version, result)
    out, lse = result[0], result[1]
    assert out.shape == q.shape, (module.__name__, version, out.shape)
    assert lse.shape == (2, 8, 96), (module.__name__, version, lse.shape)
