"""Measure the cost model's hardware constants on this CPU machine and write them as JSON.

    python benchmarks/calibrate_cpu.py            # about 90 s on 2 cores (3 runs)
    python benchmarks/calibrate_cpu.py --runs 5 --out /tmp/cpu_calibration.json

Everything is measured the way the runtime and the benchmarks run: H gloo ranks (spawned with
apbv.distributed.spawn_local) with one thread each, all measuring at the same time, so they
share the cores and the memory bus as in a benchmark, with the runtime's own code:

- matmul: F.linear at the "medium" benchmark model's MLP shape;
- attention: apbv.attention.kernels.attention with the "sdpa" backend on a causal 4096-token
  square and on 2048 rows against 8192 keys, at head dims 16, 64 and 128, fitted as seconds
  per pair and head = 4 * D / attention_flops + attention_pair_s;
- memory bandwidth: a large elementwise add; link: gloo all-gathers through apbv.comm
  (latency: one element; bandwidth: 4 MiB per rank);
- preprocessing: apbv.video decoding and resizing a rank's frames of synthetic 448x448 videos
  with 8 and 64 frames per rank (seconds per pixel, and a fixed part), the patch rows the
  tower takes of them (``QwenVL.tower_rows``: int8 pixel levels by default), the prompt with
  20000 video placeholders (built by apbv.sequence.prompt_ids);
- the vision tower's patch embedding as the runtime runs it (``vision.patch_embed`` on
  ``tower_rows``: one integer product of the levels by default; the constant keeps its name
  ``conv_flops``);
- host overhead: the tiny checkpoint's prefill (per decoder layer), vision tower (per block)
  and one vision attention call, on inputs too small to cost compute;
- decode per coded frame walked, per keyframe interval walked into and resize per sampled
  frame on camera footage (20 s of 1080p H.264, a keyframe every 2 s, 3 B-frames;
  ``benchmarks/footage_decode.py``), in this process after the runs.

The single-process ``full`` baseline runs with H threads: its speedup over one thread is
measured in this process. ``--runs`` whole runs (3 by default) are made and each constant is
the median of its runs' values.

Writes ``{"hardware": {...}, "measurements": {...}, ...}``: ``apbv.cost.Hardware.from_json``
reads it, and ``apbv.cost.CPU`` holds the committed values.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import finish_calibration

from apbv import comm
from apbv.cost import CPU, Hardware
from apbv.distributed import DistInfo, ranks_ready, spawn_local
from apbv.timing import best_time

HEAD_DIMS = (16, 64, 128)
# The two shapes of the calls that dominate long prompts: a causal square (a block, or the whole
# prompt in full mode) and rows against many keys (a block against the anchor and the passed
# tokens), as (rows, keys, causal). Short calls run ~20% slower.
ATTN_SHAPES = ((4096, 4096, True), (2048, 8192, False))
ATTN_HEADS, ATTN_KV_HEADS = 4, 2
MATMUL = (4096, 256, 768)  # rows, in, out: an MLP matmul of the "medium" benchmark model
VIDEO_SIZE = 448  # pixels, square, sampled whole (as in the TTFT benchmark)
RANK_FRAMES = (8, 64)  # frames each rank decodes: the slope is per pixel, the rest is fixed
CONV_PATCHES = 16384


def _best(fn: Callable[[], Any], repeats: int = 5) -> float:
    """Best wall time of this rank's calls after one warm-up, the ranks starting together."""
    return best_time(fn, repeats, slowest_rank=False)


def _matmul_s() -> float:
    rows, d_in, d_out = MATMUL
    x, w = torch.randn(rows, d_in), torch.randn(d_out, d_in)
    return _best(lambda: F.linear(x, w))


def _attention_s(head_dim: int, rows: int, keys: int, causal: bool) -> float:
    from apbv.attention.kernels import attention

    q = torch.randn(1, rows, ATTN_HEADS, head_dim)
    k, v = (torch.randn(1, keys, ATTN_KV_HEADS, head_dim) for _ in range(2))
    return _best(lambda: attention(q, k, v, causal=causal, backend="sdpa"))


def _pairs(rows: int, keys: int, causal: bool) -> int:
    return rows * (rows + 1) // 2 if causal else rows * keys


def _gather_s(elements: int, repeats: int) -> float:
    x = torch.zeros(elements)
    comm.all_gather(x)
    times = []
    for _ in range(repeats):
        comm.barrier()
        start = time.perf_counter()
        comm.all_gather(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _call_s(module: torch.nn.Module, calls: int = 200) -> float:
    """One attention call of the vision tower on a tiny window, through the attention function
    its config selects (``vision.attention``: the grouped one by default)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attend = ALL_ATTENTION_FUNCTIONS[module.config._attn_implementation]
    q, k, v = (torch.randn(1, module.num_heads, 4, module.head_dim) for _ in range(3))

    def run() -> None:
        for _ in range(calls):
            attend(module, q, k, v, None, scaling=module.scaling, is_causal=False)

    return _best(run) / calls


def _random_frames(count: int, side: int) -> torch.Tensor:
    """``count`` random uint8 frames (count, 3, side, side)."""
    return torch.randint(0, 256, (count, 3, side, side), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(count))


def _rank_job(info: DistInfo, model_dir: str, videos: dict[int, str]) -> dict[str, Any]:
    """Every measurement of one rank; ``videos`` maps frames per rank to a video file."""
    from apbv.engine.prefill import prefill
    from apbv.model.qwen2_5_vl.adapter import load
    from apbv.plan import make_plan
    from apbv.sequence import prompt_ids, split_prompt
    from apbv.video import VideoSpec, load_rank_frames

    out: dict[str, Any] = {}
    world = info.world_size
    out["matmul_s"] = _matmul_s()
    out["attention_s"] = {f"{d} {rows}x{keys}{' causal' if causal else ''}":
                          _attention_s(d, rows, keys, causal)
                          for d in HEAD_DIMS for rows, keys, causal in ATTN_SHAPES}
    a, b, c = (torch.randn(1 << 23) for _ in range(3))
    out["add_s"] = _best(lambda: torch.add(a, b, out=c))
    out["gather_small_s"] = _gather_s(1, 30)
    out["gather_large_s"] = _gather_s(1 << 20, 5)

    model = load(model_dir, device=torch.device("cpu"), dtype=torch.float32)
    ranks_ready("model loaded")  # the measurements below start together
    processor = model.processor
    out["load_s"], out["process_s"] = {}, {}
    for frames_per_rank, path in videos.items():
        spec = VideoSpec(path, fps=2.0, max_pixels=VIDEO_SIZE**2, min_pixels=3136)
        out["load_s"][frames_per_rank] = _best(
            lambda spec=spec: load_rank_frames(spec, info.rank, world), repeats=3)
        frames = load_rank_frames(spec, info.rank, world).frames
        assert frames.shape[0] == frames_per_rank, (frames.shape, frames_per_rank)
        out["process_s"][frames_per_rank] = _best(
            lambda frames=frames: model.tower_rows(frames), repeats=3)
    question = "What colour is the square in the last second?"
    context, query = split_prompt(processor, question)
    out["tokenize_tokens"] = 20000
    out["tokenize_s"] = _best(lambda: prompt_ids(processor.tokenizer, context, query, question,
                                                 20000))

    # Host overhead: the runtime's prefill and vision tower on inputs too small to compute.
    plan = make_plan(64, 8, world)
    embeds = torch.randn(1, plan.local_len(info.rank), model.text_config.hidden_size)
    positions = torch.arange(plan.local_len(info.rank)).expand(3, 1, -1)
    out["prefill_s"] = _best(lambda: prefill(model, embeds, positions, plan, info))
    last = embeds[0, -1]
    out["lm_head_s"] = _best(lambda: model.logits(last))
    out["layers"] = model.num_layers
    out["blocks_per_rank"] = plan.blocks_per_rank
    # One frame of 8x8 patches: one window, so each vision block makes one attention call.
    pixels, grid = model.tower_rows(_random_frames(2, 8 * 14))
    with torch.inference_mode():
        out["vision_s"] = _best(lambda: model.vision_tower(pixels, grid))
    out["call_s"] = _call_s(model.model.model.visual.blocks[0].attn)
    side = 14 * int((CONV_PATCHES // 16) ** 0.5)  # 16 temporal patches of CONV_PATCHES / 16
    patches = model.tower_rows(_random_frames(32, side))[0]
    assert patches.shape[0] == CONV_PATCHES, patches.shape
    with torch.inference_mode():
        out["conv_s"] = _best(lambda: model.model.model.visual.patch_embed(patches))
    out["conv_flops"] = 2 * CONV_PATCHES * patches.shape[1] * model.vision_config.hidden_size
    out["vision_depth"] = model.vision_config.depth
    return out


def _thread_efficiency(threads: int) -> dict[str, float]:
    """Throughput with ``threads`` threads over ``threads`` times one thread's (best of
    alternating runs, so a passing load on the machine hits both alike)."""
    result = {}
    for name, fn in (("matmul", _matmul_s),
                     ("attention", lambda: _attention_s(64, *ATTN_SHAPES[1]))):
        best = {1: float("inf"), threads: float("inf")}
        for _ in range(3):
            for n in best:
                torch.set_num_threads(n)
                best[n] = min(best[n], fn())
        result[name] = best[1] / (threads * best[threads])
    torch.set_num_threads(1)
    return result


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept); slope through the origin if the intercept is < 0."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    if intercept < 0:
        return sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs), 0.0
    return slope, intercept


def _mean(per_rank: list[dict[str, Any]], *keys: Any) -> float:
    values = []
    for r in per_rank:
        for key in keys:
            r = r[key]
        values.append(r)
    return sum(values) / len(values)


def _round(hw: Hardware) -> Hardware:
    """Every number to 4 significant digits (the measurements vary more than that)."""
    return Hardware(**{k: float(f"{v:.4g}") if isinstance(v, float) else v
                       for k, v in hw.to_json().items()})


def constants(per_rank: list[dict[str, Any]], efficiency: dict[str, float],
              world: int) -> Hardware:
    """The Hardware constants from the ranks' measurements (means over ranks)."""
    rows, d_in, d_out = MATMUL
    matmul_flops = 2 * rows * d_in * d_out / _mean(per_rank, "matmul_s")
    points = [(4.0 * d, _mean(per_rank, "attention_s", f"{d} {rows}x{keys}"
                              f"{' causal' if causal else ''}")
               / (_pairs(rows, keys, causal) * ATTN_HEADS))
              for d in HEAD_DIMS for rows, keys, causal in ATTN_SHAPES]
    slope, pair_s = _fit_line([x for x, _ in points], [y for _, y in points])
    latency = _mean(per_rank, "gather_small_s")
    received = (world - 1) * (1 << 20) * 4
    link_bw = received / max(_mean(per_rank, "gather_large_s") - latency, 1e-9)
    # Frames: time = fixed + frames * pixels * per_pixel, two frame counts.
    pixels = [f * VIDEO_SIZE**2 for f in RANK_FRAMES]
    decode, decode_fixed = _fit_line(pixels, [_mean(per_rank, "load_s", f) for f in RANK_FRAMES])
    process, process_fixed = _fit_line(pixels, [_mean(per_rank, "process_s", f)
                                                for f in RANK_FRAMES])
    tokenize = _mean(per_rank, "tokenize_s") / _mean(per_rank, "tokenize_tokens")
    # Overheads: tiny inputs, so the time is dispatch (collective latencies taken out).
    layers = _mean(per_rank, "layers")
    collectives = (_mean(per_rank, "blocks_per_rank") + 1) * latency if world > 1 else 0.0
    layer = ((_mean(per_rank, "prefill_s") - _mean(per_rank, "lm_head_s")) / layers
             - collectives)
    depth = _mean(per_rank, "vision_depth")
    call = _mean(per_rank, "call_s")
    vision_layer = (_mean(per_rank, "vision_s") - depth * call) / depth
    return _round(Hardware(
        name="cpu",
        matmul_flops=matmul_flops,
        conv_flops=_mean(per_rank, "conv_flops") / _mean(per_rank, "conv_s"),
        attention_flops=1.0 / slope,
        attention_pair_s=pair_s,
        memory_bw=3 * 4 * (1 << 23) / _mean(per_rank, "add_s"),
        link_bw=link_bw,
        link_latency_s=latency,
        decode_s_per_pixel=decode,
        process_s_per_pixel=process,
        preprocess_fixed_s=decode_fixed + process_fixed,
        tokenize_s_per_token=tokenize,
        layer_overhead_s=max(layer, 0.0),
        vision_layer_overhead_s=max(vision_layer, 0.0),
        call_overhead_s=max(call, 0.0),
        host_overlaps_device=False,
        full_uses_all_ranks=True,
        thread_efficiency=sum(efficiency.values()) / len(efficiency),
        dtype_bytes=4,
    ))


def median_constants(runs: list[Hardware]) -> Hardware:
    """Each constant's median over whole calibration runs (flags and names from the first):
    on a shared machine one run's host overheads swing by up to 2-3x, its compute rates by
    10-30%."""
    fields = runs[0].to_json()
    return Hardware(**{k: statistics.median(r.to_json()[k] for r in runs)
                       if isinstance(v, float) else v for k, v in fields.items()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="H ranks, one thread each")
    parser.add_argument("--runs", type=int, default=3,
                        help="whole calibration runs; each constant is their median")
    parser.add_argument("--out", default="benchmarks/results/cpu_calibration.json")
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.runs < 1:
        parser.error("--world-size and --runs must be >= 1")
    started = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="apbv-calibrate-") as tmp:
        from apbv.model.qwen2_5_vl.tiny import write_tiny_checkpoint
        from apbv.synthetic.videos import write_test_video

        print("[calibrate] writing the tiny checkpoint and test videos", file=sys.stderr,
              flush=True)
        model = str(write_tiny_checkpoint(Path(tmp) / "tiny"))
        videos = {f: str(write_test_video(Path(tmp) / f"v{f}.mp4", num_frames=f * args.world_size,
                                          fps=2.0, width=VIDEO_SIZE, height=VIDEO_SIZE, seed=f))
                  for f in RANK_FRAMES}
        for run in range(args.runs):
            print(f"[calibrate] run {run + 1}/{args.runs}: {args.world_size} ranks x 1 thread, "
                  f"then 1 vs {args.world_size} threads in one process", file=sys.stderr,
                  flush=True)
            per_rank = spawn_local(_rank_job, args.world_size, (model, videos), timeout_s=600)
            efficiency = _thread_efficiency(args.world_size)
            runs.append({"per_rank": per_rank, "thread_efficiency": efficiency,
                         "hardware": constants(per_rank, efficiency, args.world_size)})
        from footage_decode import coded_frame_rates

        from apbv.video.footage import write_camera_video

        print("[calibrate] decode per coded frame on camera footage", file=sys.stderr,
              flush=True)
        footage = coded_frame_rates(str(write_camera_video(
            Path(tmp) / "camera.mp4", seconds=20, fps=30, width=1920, height=1080,
            gop_seconds=2.0, bframes=3)))
    hw = _round(dataclasses.replace(median_constants([r["hardware"] for r in runs]),
                                    coded_frame_s_per_pixel=footage["coded_frame_s_per_pixel"],
                                    keyframe_s_per_pixel=footage["keyframe_s_per_pixel"],
                                    convert_s_per_pixel=footage["convert_s_per_pixel"],
                                    # measured by bench_eval.py, not here: kept
                                    sample_overhead_s=CPU.sample_overhead_s))
    report = {
        "hardware": hw.to_json(),
        "measurements": {"footage_decode": footage,
                         "runs": [{**r, "hardware": r["hardware"].to_json()} for r in runs]},
        "setup": {"world_size": args.world_size, "runs": args.runs, "matmul": MATMUL,
                  "head_dims": HEAD_DIMS,
                  "attention": {"shapes": ATTN_SHAPES, "heads": ATTN_HEADS,
                                "kv_heads": ATTN_KV_HEADS},
                  "video_size": VIDEO_SIZE, "rank_frames": RANK_FRAMES,
                  "conv_patches": CONV_PATCHES},
    }
    finish_calibration(args.out, report, "calibrate_cpu", started)


if __name__ == "__main__":
    main()
