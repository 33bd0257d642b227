"""Measure the cost model's device constants on one GPU and write them as JSON.

    python benchmarks/calibrate_gpu.py      # one CUDA device, about 2 minutes on an H200
    python benchmarks/calibrate_gpu.py --dry-run   # the same code on CPU at toy sizes

What is measured, in bf16, on one device (``scripts/gpu_check.sh`` runs it):

- the kernel adapter (apbv.attention.kernels.attention) with SDPA, and flash-attn when it is
  installed: its error against the fp32 CPU reference on a small case, and its time on causal
  squares of several lengths (attention_flops, a fit over the lengths);
- F.linear at the 7B's MLP shape (matmul_flops), a large add of two tensors into a third
  (memory_bw: two reads and a write; ``a + a`` would read ``a`` once), the vision tower's
  patch embedding as the runtime runs it (conv_flops);
- one decoder layer of a Qwen2.5-VL-7B-shaped random model at several prompt lengths, and its
  vision tower as the runtime sets it up (:func:`apbv.model.common.tower.set_tower`) on frames
  of the 1440p video cap (1008x560) at several temporal-patch counts; at the smallest and the
  largest also transformers' stock tower and the runtime's changes added in turn
  (:data:`TOWER_VARIANTS`);
- host overhead: the layer and the tower on inputs too small to compute;
- ``video.resize_device=cuda``: decoded-size uint8 frames (1440p) resized on the device to the
  1008x560 cap and made into patch rows there, timed, and its pixels' difference to the CPU
  resize that matches qwen-vl-utils (skipped without torchvision).

The output has the form ``benchmarks/calibrate_cpu.py`` writes (``{"hardware": {...},
"measurements": {...}, ...}``; ``apbv.cost.Hardware.from_json`` reads it). What one GPU cannot
measure keeps the ``h200`` preset's value and is listed under ``"not_measured"``: the link
(one device has no peer) and the host's frame decoding, processing and tokenizing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import STOCK_TOWER, finish_calibration

from apbv.attention import kernels
from apbv.cost import Hardware, ModelDims, hardware, model_dims
from apbv.cost.hardware import Machine, write_calibration
from apbv.cost.schedule import vision_calls, vision_cost

# (7B-shaped sizes, toy sizes for --dry-run)
SIZES = {
    "gpu": {"attn_lengths": (4096, 8192, 16384), "layer_lengths": (4096, 16384, 32768),
            "vision_patches": (2, 8, 16), "matmul_rows": 8192, "add_elements": 1 << 28,
            "conv_patches": 65536, "repeats": 5},
    "dry": {"attn_lengths": (128, 256), "layer_lengths": (64, 128), "vision_patches": (1, 2),
            "matmul_rows": 64, "add_elements": 1 << 16, "conv_patches": 256, "repeats": 1},
}
HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128  # the 7B's decoder attention
MLP_SHAPE = (3584, 18944)  # the 7B's decoder MLP (in, out): matmul_flops
FRAME_GRID = (40, 72)  # ViT patches of a 1008x560 frame (the 1440p video cap)
FRAME_GRIDS = {"gpu": FRAME_GRID, "dry": (8, 12)}
"""ViT patches per frame of the vision tower's inputs (recorded as the setup's frame_grid)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _kernel_checks(device: torch.device, dtype: torch.dtype, sizes: dict) -> dict[str, Any]:
    backends = ["sdpa"] + (["flash"] if device.type == "cuda" and kernels.flash_available()
                           else [])
    g = torch.Generator().manual_seed(0)
    small = [torch.randn(1, 300, h, HEAD_DIM, generator=g).to(dtype)
             for h in (HEADS, KV_HEADS, KV_HEADS)]
    ref, _ = kernels.attention(*(t.float() for t in small), causal=True, backend="reference")
    out: dict[str, Any] = {"backends": backends, "max_abs_error_vs_cpu_reference": {},
                           "causal_s": {}}
    for backend in backends:
        got, _ = kernels.attention(*(t.to(device) for t in small), causal=True, backend=backend)
        err = (got.float().cpu() - ref).abs().max().item()
        out["max_abs_error_vs_cpu_reference"][backend] = err
        for length in sizes["attn_lengths"]:
            q, k, v = (torch.randn(1, length, h, HEAD_DIM, device=device, dtype=dtype)
                       for h in (HEADS, KV_HEADS, KV_HEADS))
            out["causal_s"][f"{backend} {length}"] = _best(
                lambda q=q, k=k, v=v, b=backend: kernels.attention(q, k, v, causal=True,
                                                                   backend=b),
                device, sizes["repeats"])
        print(f"[calibrate-gpu] kernel {backend}: max abs error {err:.2e} vs the CPU reference",
              file=sys.stderr, flush=True)
    return out


def _attention_flops(checks: dict[str, Any], backend: str, sizes: dict) -> float:
    """FLOP/s at the longest length (4 * D FLOPs per visible pair and head)."""
    length = sizes["attn_lengths"][-1]
    pairs = length * (length + 1) / 2
    return 4 * HEAD_DIM * pairs * HEADS / checks["causal_s"][f"{backend} {length}"]


def _add_s(device: torch.device, dtype: torch.dtype, sizes: dict) -> float:
    """Seconds of ``torch.add(a, b, out=c)`` on large tensors: two reads and a write
    (``add_streams``: 3), the memory bandwidth's measurement."""
    a, b, c = (torch.randn(sizes["add_elements"], device=device, dtype=dtype) for _ in "abc")
    return _best(lambda: torch.add(a, b, out=c), device, sizes["repeats"])


def _device_resize(device: torch.device, frames: int, repeats: int) -> dict[str, Any]:
    """``video.resize_device``: the resize (+ patch rows) of decoded-size uint8 frames on
    ``device``, timed, and its difference to the CPU resize (qwen-vl-utils' pixels)."""
    from apbv.model.qwen2_5_vl.tiny import PREPROCESSOR_CONFIG as released
    from apbv.video.load import resize_frames  # torchvision is imported when it resizes
    from apbv.video.patches import PatchSpec, patch_rows

    try:
        decoded = torch.randint(0, 256, (frames, 1440, 2560, 3), dtype=torch.uint8,
                                generator=torch.Generator().manual_seed(3))
        decoded = decoded.permute(0, 3, 1, 2)  # channels-last, as the decoders give them
        size = (FRAME_GRID[0] * 14, FRAME_GRID[1] * 14)
        cpu = resize_frames(decoded, size)
    except ImportError as err:  # torchvision is not installed
        return {"skipped": f"{err}"}
    spec = PatchSpec(released["patch_size"], released["merge_size"],
                     released["temporal_patch_size"], tuple(released["image_mean"]),
                     tuple(released["image_std"]), 1 / 255)
    on_device = decoded.to(device)
    seconds = _best(lambda: patch_rows(resize_frames(on_device, size), spec), device, repeats)
    diff = (resize_frames(on_device, size).cpu().int() - cpu.int()).abs()
    return {"frames": frames, "source": [1440, 2560], "resized": list(size),
            "resize_and_rows_s": seconds,
            "s_per_resized_pixel": seconds / (frames * size[0] * size[1]),
            "max_abs_diff_levels": int(diff.max()), "mean_abs_diff_levels": float(diff.float()
                                                                                .mean()),
            "fraction_differing": float((diff > 0).float().mean())}


def seven_b_config() -> Any:
    """Qwen2.5-VL-7B's widths (the tiny checkpoint's vocabulary and token ids), one decoder
    layer."""
    from transformers import Qwen2_5_VLConfig

    from apbv.model.common.hf_compat import rope_config
    from apbv.model.qwen2_5_vl.tiny import tiny_config

    data = tiny_config("tiny").to_dict()
    data["text_config"].update({
        "hidden_size": 3584, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "intermediate_size": 18944, "num_hidden_layers": 1, "max_window_layers": 1,
        **rope_config([16, 24, 24], 1000000.0)})
    for key in ("head_dim", "layer_types"):
        data["text_config"].pop(key, None)
    data["vision_config"].update({
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
        "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31]})
    return Qwen2_5_VLConfig.from_dict(data)


def _model(device: torch.device, dtype: torch.dtype, dry: bool) -> Any:
    """A Qwen2.5-VL-7B-shaped random model with one decoder layer (the tiny one for dry runs)."""
    from apbv.model.common.hook import register_attention
    from apbv.model.qwen2_5_vl.tiny import build_tiny_model

    register_attention()
    if dry:
        return build_tiny_model().to(device, dtype).eval()
    config = seven_b_config()
    from transformers import Qwen2_5_VLForConditionalGeneration

    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration(config)
    return model.to(dtype).eval()


TOWER_VARIANTS = {  # name: config overrides of the vision settings (the rest: the defaults)
    "stock": STOCK_TOWER,
    "+ grouped": ("vision.patch_embed=conv", "vision.rotary=stock", "vision.norm=stock",
                  "vision.mlp_pad=0"),
    "+ mlp pad": ("vision.patch_embed=conv", "vision.rotary=stock", "vision.norm=stock"),
    "runtime": (),  # + linear patch embedding, fused rotary and norms
}
"""The vision tower's set-ups timed side by side, each change of the runtime added in turn."""


def _layer_and_tower(model: Any, device: torch.device, dtype: torch.dtype, sizes: dict,
                     frame_grid: tuple[int, int]) -> dict[str, Any]:
    from apbv.config import load_config
    from apbv.model.common.tower import set_tower

    lm = model.model.language_model
    lm.config._attn_implementation = "sdpa"
    hidden = lm.config.hidden_size
    out: dict[str, Any] = {"layer_s": {}, "vision_s": {}, "vision_variants_s": {}}

    def layer(length: int) -> float:
        x = torch.randn(1, length, hidden, device=device, dtype=dtype)
        pos = torch.arange(length, device=device).view(1, 1, -1).expand(3, 1, -1)
        return _best(lambda: lm(inputs_embeds=x, position_ids=pos, use_cache=False), device,
                     sizes["repeats"])

    with torch.inference_mode():
        out["layer_s"]["16"] = layer(16)
        for length in sizes["layer_lengths"]:
            out["layer_s"][str(length)] = layer(length)
            print(f"[calibrate-gpu] decoder layer at {length} tokens: "
                  f"{out['layer_s'][str(length)]:.4f} s", file=sys.stderr, flush=True)
        visual = model.model.visual
        rows, cols = frame_grid
        dim = visual.patch_embed.proj.weight[0].numel()

        def tower(patches: int, h: int = rows, w: int = cols) -> float:
            px = torch.randn(patches * h * w, dim, device=device, dtype=dtype)
            grid = torch.tensor([[patches, h, w]], device=device)
            return _best(lambda: visual(px, grid_thw=grid), device, sizes["repeats"])

        ends = sorted({sizes["vision_patches"][0], sizes["vision_patches"][-1]})
        for name, overrides in TOWER_VARIANTS.items():
            set_tower(model, load_config("tiny_cpu", list(overrides)).vision, device)
            out["vision_variants_s"][name] = {str(p): tower(p) for p in ends}
            print(f"[calibrate-gpu] vision tower, {name}: " + ", ".join(
                f"{s:.4f} s at {p} temporal patches"
                for p, s in out["vision_variants_s"][name].items()), file=sys.stderr, flush=True)
        # the runtime's tower (set up last, above) at every size
        out["vision_small_s"] = tower(1, 8, 8)  # one window per frame: host overhead
        for patches in sizes["vision_patches"]:
            out["vision_s"][str(patches)] = tower(patches)
            print(f"[calibrate-gpu] vision tower, {patches} temporal patches of {rows}x{cols}:"
                  f" {out['vision_s'][str(patches)]:.4f} s", file=sys.stderr, flush=True)
        out["vision_depth"] = len(visual.blocks)
    return out


def _vision_efficiency(hw: Hardware, dims: ModelDims, grid: tuple[int, int],
                       vision_s: dict[str, float]) -> float:
    """``vision_elementwise_efficiency``: the tower's measured time per temporal patch (the
    slope between the two largest counts, where the device bounds it, not the host) less the
    modelled products and attention, against the modelled elementwise passes at the full
    memory bandwidth (1.0 when the products alone explain the slope)."""
    a, b = sorted(int(p) for p in vision_s)[-2:]
    slope = (vision_s[str(b)] - vision_s[str(a)]) / (b - a)
    device = dataclasses.replace(hw, vision_layer_overhead_s=0.0, call_overhead_s=0.0,
                                 vision_elementwise_efficiency=1.0)

    def per_patch(h: Hardware) -> float:
        m = Machine(h, h.dtype_bytes)
        return (vision_cost(dims, b, grid, m)[0] - vision_cost(dims, a, grid, m)[0]) / (b - a)

    compute = per_patch(dataclasses.replace(device, memory_bw=float("inf")))
    passes = per_patch(device) - compute
    return min(1.0, passes / (slope - compute)) if slope > compute else 1.0


def _dims(dry: bool) -> ModelDims:
    """The measured model's dimensions (no weights built)."""
    from apbv.model.qwen2_5_vl.tiny import tiny_config

    return model_dims((tiny_config("tiny") if dry else seven_b_config()).to_dict())


def _call_overhead(measured: dict[str, Any], dims: ModelDims, grid: tuple[int, int]) -> float:
    """``call_overhead_s``: host seconds per attention call of the stock per-window tower, its
    time at the largest count (one call per window and temporal patch: host-bound on a GPU)
    less the per-block overhead (the small tower's time), over its calls."""
    stock = measured["vision_variants_s"]["stock"]
    patches = max(int(p) for p in stock)
    calls = vision_calls(dims, patches, grid, grouped=False)
    return max(0.0, (stock[str(patches)] - measured["vision_small_s"]) / calls)


def derive(measured: dict[str, Any], setup: dict[str, Any], name: str) -> Hardware:
    """The :class:`Hardware` constants of a run's ``measured`` values and ``setup`` (its
    sizes, frame grid, attention backend; ``--refit`` reads both back from a calibration
    file). The link and the host's frame work keep the ``h200`` preset's values."""
    sizes, dims = setup["sizes"], _dims(setup["device"].startswith("cpu"))
    grid = tuple(g // dims.spatial_merge_size for g in setup["frame_grid"])
    d_in, d_out = MLP_SHAPE
    patch_in = dims.in_channels * dims.temporal_patch_size * dims.patch_size**2

    def sig(value: float) -> float:
        return float(f"{value:.4g}")

    hw = Hardware.from_json({
        **hardware("h200").to_json(),
        "name": name,
        "matmul_flops": sig(2 * sizes["matmul_rows"] * d_in * d_out / measured["matmul_s"]),
        "conv_flops": sig(2 * sizes["conv_patches"] * patch_in * dims.vision_hidden
                          / measured["conv_s"]),
        "attention_flops": sig(_attention_flops(measured["kernels"], setup["attention_backend"],
                                                sizes)),
        "attention_pair_s": 0.0,
        "memory_bw": sig(add_streams(measured) * 2 * sizes["add_elements"]
                         / measured["add_s"]),
        "layer_overhead_s": sig(measured["layer_s"]["16"]),
        "vision_layer_overhead_s": sig(measured["vision_small_s"] / measured["vision_depth"]),
        "call_overhead_s": sig(_call_overhead(measured, dims, grid)),
        "vision_elementwise_efficiency": 1.0,
    })
    efficiency = _vision_efficiency(hw, dims, grid, measured["vision_s"])
    return dataclasses.replace(hw, vision_elementwise_efficiency=sig(efficiency),
                               attention_kernel=kernel_rates(setup))


def add_streams(measured: dict[str, Any]) -> int:
    """Bf16 tensors the timed add moves through memory: 3 (``torch.add(a, b, out=c)``: two
    reads, one write), recorded as ``add_streams``; 2 for a file without it, whose add was
    ``a + a`` (``a`` is read once: one read, one write)."""
    return int(measured.get("add_streams", 2))


def kernel_rates(setup: dict[str, Any]) -> str:
    """What ``attention_flops`` is the rate of: the kernel adapter's backend, the device and
    the torch that measured it (``Hardware.attention_kernel``)."""
    backend = {"sdpa": "PyTorch SDPA", "flash": "flash-attn"}.get(setup["attention_backend"],
                                                                   setup["attention_backend"])
    return f"{backend} measured on {setup['device']}, torch {setup.get('torch', '?')}"


def refit(path: str, name: str) -> None:
    """Derive the constants of the calibration file ``path`` again from its measurements
    (after a change of :func:`derive`; no GPU needed) and write it back."""
    report = json.loads(Path(path).read_text())
    report["setup"].setdefault("torch", report.get("torch", "?"))
    report["hardware"] = derive(report["measurements"], report["setup"], name).to_json()
    report["refit"] = "hardware derived again from the measurements by calibrate_gpu.py --refit"
    write_calibration(path, report, "calibrate_gpu --refit")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/h200_calibration.json")
    parser.add_argument("--name", default="h200", help="the hardware name written")
    parser.add_argument("--dry-run", action="store_true",
                        help="toy sizes on CPU (checks the code path without a GPU)")
    parser.add_argument("--refit", action="store_true",
                        help="measure nothing: derive the constants of --out again from its "
                             "measurements")
    args = parser.parse_args(argv)
    if args.refit:
        refit(args.out, args.name)
        return
    started = time.perf_counter()
    if not args.dry_run and not torch.cuda.is_available():
        print("[calibrate-gpu] skipped: no CUDA device (use --dry-run to check the code path)")
        return
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.bfloat16
    kind = "dry" if args.dry_run else "gpu"
    sizes = SIZES[kind]
    torch.manual_seed(0)

    checks = _kernel_checks(device, dtype, sizes)
    backend = "flash" if "flash" in checks["backends"] else "sdpa"
    x = torch.randn(sizes["matmul_rows"], MLP_SHAPE[0], device=device, dtype=dtype)
    w = torch.randn(MLP_SHAPE[1], MLP_SHAPE[0], device=device, dtype=dtype)
    matmul_s = _best(lambda: F.linear(x, w), device, sizes["repeats"])
    add_s = _add_s(device, dtype, sizes)

    model = _model(device, dtype, args.dry_run)
    measured = _layer_and_tower(model, device, dtype, sizes, FRAME_GRIDS[kind])
    proj = model.model.visual.patch_embed  # the runtime's (set up last above)
    pixels = torch.randn(sizes["conv_patches"], proj.proj.weight[0].numel(), device=device,
                         dtype=dtype)
    with torch.inference_mode():
        conv_s = _best(lambda: proj(pixels), device, sizes["repeats"])
    resize = _device_resize(device, 2 if args.dry_run else 16, sizes["repeats"])

    measured = {"kernels": checks, "matmul_s": matmul_s, "add_s": add_s, "add_streams": 3,
                "conv_s": conv_s,
                "device_resize": resize, **measured}
    setup = {"device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else "cpu (dry run)"),
             "dtype": "bfloat16", "sizes": sizes, "attention_backend": backend,
             "model": "qwen2.5-vl-7b shape, 1 decoder layer, random weights"
             if not args.dry_run else "tiny (dry run)",
             "frame_grid": FRAME_GRIDS[kind], "torch": torch.__version__}
    report = {
        "hardware": derive(measured, setup, args.name).to_json(),
        "measurements": measured,
        "not_measured": ["link_bw", "link_latency_s", "decode_s_per_pixel",
                         "process_s_per_pixel", "preprocess_fixed_s", "tokenize_s_per_token"],
        "setup": setup,
    }
    finish_calibration(args.out, report, "calibrate_gpu", started)


if __name__ == "__main__":
    main()
