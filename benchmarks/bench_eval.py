"""Samples per hour of ``apbv eval`` for each split of 2 CPU ranks into rank groups, measured
side by side in one run, with the cost model's prediction beside each, and the same table
predicted for 8 and 16 GPUs.

    python benchmarks/bench_eval.py                       # tiny random model, 8 questions
    python benchmarks/bench_eval.py --count 16 --repeats 3 \
        --out benchmarks/results/eval_groups_cpu.md

The data is ``make-eval-fixtures``' LongVideoBench set (``--count`` questions). Two gloo ranks
(one thread each) load the model twice, as one group of 2 ranks (G, H) = (1, 2) and as two
groups of 1 rank (2, 1), warm each up with one sample, then run the whole set in each split
``--repeats`` times, taking turns (so drift on a shared machine hits both alike); a split's
wall time is the median of its runs of :func:`apbv.eval.harness.run_eval` (the model load is
not counted, nor is it in the prediction). Beside them: the engine's own TTFT per sample (the
rows' ``timing``) and the cost model's, and the harness's seconds per sample (the wall time
less the engine's stages), to tell the engine's time from the harness's. The prediction is
:func:`apbv.eval.forecast.forecast` with the checkpoint's sizes on the ``cpu`` hardware as
loaded at the start of the timed runs: right after the warm-up both ranks measure their
share of a core at once (:func:`apbv.cost.calibrate.probe_rank`, a busy loop of 2 s), and
then the fixed cost of a collective on the runs' own groups, the world's two ranks and each
group of one (:func:`apbv.cost.calibrate.probe_collectives`); :func:`apbv.cost.calibrate.
loaded_groups` scales the idle preset by the share and puts each group size's collective
cost in, as ``plan --eval --hardware cpu`` does. The same measurements after each round of
runs give the prediction at the run's mean load (what the model says given the load the runs
met), and the idle preset's prediction is printed too. The
GPU tables are the same forecast for Qwen2.5-VL-7B on ``h200`` at ``--gpu-frames`` frames per
video (default 2 fps; default pixel limits).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import add_model_args, model_dir

from apbv.config import RuntimeConfig, load_config
from apbv.distributed import DistInfo, rank_groups, spawn_local

SPLITS = (1, 2)
"""G of each measured split of the 2 ranks."""


def _job(info: DistInfo, cfg: RuntimeConfig, data: str, out: str, repeats: int,
         tokens: int, video: str) -> dict[Any, Any]:
    from apbv.cost.calibrate import probe_collectives, probe_decoding, probe_rank
    from apbv.engine.engine import Engine
    from apbv.eval.harness import EvalSpec, run_eval

    engines, infos = {}, {}
    for groups in SPLITS:
        _, infos[groups] = rank_groups(info, groups)
        engines[groups] = Engine(cfg, infos[groups])
    times: dict[Any, Any] = {g: [] for g in SPLITS}
    times["probes"], times["collective_s"], times["decoding"] = [], [], []

    def measure() -> None:  # the machine as loaded for the timed runs, every rank at once
        times["probes"].append(probe_rank(info))
        times["decoding"].append({2 // g: probe_decoding(video, infos[g].rank, 2 // g)
                                  for g in SPLITS})
        times["collective_s"].append({2 // g: probe_collectives(infos[g].group)
                                      for g in SPLITS})

    for run in range(-1, repeats):  # run -1: the warm-up (one sample)
        if run >= 0:
            measure()
        for groups in SPLITS:
            spec = EvalSpec("longvideobench", data, f"{out}/g{groups}_r{run}.jsonl",
                            max_new_tokens=tokens, groups=groups,
                            limit=groups if run < 0 else None)
            start = time.perf_counter()
            run_eval(spec, cfg, lambda g=groups: engines[g], progress=io.StringIO())
            if run >= 0:
                times[groups].append(time.perf_counter() - start)
    measure()
    return times


def _stage_means(work: Any, dims: Any, hw: Any, ranks: int, mode: str,
                 tokens: int) -> dict[str, float]:
    """The cost model's mean seconds per stage of the samples of ``work`` on ``ranks``, its
    TTFT (``ttft``) and the request's collectives outside the stages (``bookkeeping``)."""
    from apbv.cost import Workload, estimate
    from apbv.modes import get_mode

    out: dict[str, float] = {}
    for w in work:
        p = estimate(get_mode(mode), dims, Workload.of(
            dims, context_len=w.context_len, query_len=w.query_len, world_size=ranks,
            frames=w.frames, grid=w.grid, answer_tokens=tokens), hw)
        for stage, s in [*p.seconds.items(), ("ttft", p.ttft_s),
                         ("bookkeeping", p.bookkeeping_s)]:
            out[stage] = out.get(stage, 0.0) + s / len(work)
    return out


def _table(rows: list[tuple[Any, ...]], head: tuple[str, ...]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(str(c) for c in r) + " |" for r in rows)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--count", type=int, default=8, help="LongVideoBench fixture questions")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--pixels", type=int, default=112 * 112,
                        help="per-frame pixels (video.min_pixels = max_pixels)")
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--gpu-frames", type=int,
                        help="frames per video in the GPU tables (default: 2 fps, the presets')")
    parser.add_argument("--out", help="markdown file to write (default: stdout only)")
    args = parser.parse_args()

    from apbv import cost
    from apbv.cost.calibrate import loaded_groups, mean_decoding, slowdown
    from apbv.eval.data import load_samples
    from apbv.eval.forecast import forecast, forecast_lines, sample_work
    from apbv.synthetic.eval_fixtures import make_eval_fixtures
    from apbv.synthetic.videos import write_decode_probe

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        root = Path(tmp)
        model = model_dir(args, root)
        data = make_eval_fixtures("longvideobench", root / "lvb", count=args.count).parent
        cfg = load_config("tiny_cpu", [f"model.path={model!r}",
                                       f"video.min_pixels={args.pixels}",
                                       f"video.max_pixels={args.pixels}"])
        samples = load_samples("longvideobench", data)
        dims = cost.checkpoint_dims(model)
        video = {"min_pixels": args.pixels, "max_pixels": args.pixels}
        work = sample_work(samples, dims, video)
        (root / "out").mkdir()
        ttft: dict[int, list[float]] = {g: [] for g in SPLITS}
        harness: dict[int, list[float]] = {g: [] for g in SPLITS}
        stage_rows: dict[int, list[dict[str, float]]] = {g: [] for g in SPLITS}
        per_rank = spawn_local(_job, 2, (cfg, str(data), str(root / "out"), args.repeats,
                                         args.max_new_tokens, write_decode_probe(root)),
                               timeout_s=3000, collective_timeout_s=600)
        times = per_rank[0]
        idle = cost.hardware("cpu")
        first = {h: statistics.fmean(r["collective_s"][0][h] for r in per_rank)
                 for h in (2, 1)}
        mean = {h: statistics.fmean(c[h] for r in per_rank for c in r["collective_s"])
                for h in (2, 1)}
        decoding = {h: mean_decoding([r["decoding"][0][h] for r in per_rank]) for h in (2, 1)}
        decoding_during = {h: mean_decoding([d[h] for r in per_rank for d in r["decoding"]])
                           for h in (2, 1)}
        loaded = loaded_groups(idle, [r["probes"][0] for r in per_rank], first, decoding)
        during = loaded_groups(idle, [p for r in per_rank for p in r["probes"]], mean,
                               decoding_during)
        predicted = {f.groups: f for f in forecast(
            work, dims, loaded, world_size=2, mode=cfg.attention.mode,
            answer_tokens=args.max_new_tokens, groups=SPLITS)}
        predicted_during = {f.groups: f for f in forecast(
            work, dims, during, world_size=2, mode=cfg.attention.mode,
            answer_tokens=args.max_new_tokens, groups=SPLITS)}
        predicted_idle = {f.groups: f for f in forecast(
            work, dims, idle, world_size=2, mode=cfg.attention.mode,
            answer_tokens=args.max_new_tokens, groups=SPLITS)}
        for g in SPLITS:  # the engine's own TTFT of each sample (rank 0's row), every run
            for run in range(args.repeats):
                rows = [json.loads(line) for line in
                        (root / "out" / f"g{g}_r{run}.jsonl").read_text().splitlines()]
                ttft[g] += [r["timing"]["ttft_s"] for r in rows]
                stage_rows[g] += [r["timing"]["seconds"] for r in rows]
                engine_s = sum(sum(r["timing"]["seconds"].values()) for r in rows) / g
                harness[g].append((times[g][run] - engine_s) / (len(rows) / g))
        stage_predicted = {g: _stage_means(work, dims, loaded[2 // g], 2 // g,
                                           cfg.attention.mode, args.max_new_tokens)
                           for g in SPLITS}
        ttft_predicted = {g: stage_predicted[g]["ttft"] for g in SPLITS}
        # outside the stages per sample, as measured: the wall time less the stages
        outside_predicted = {g: predicted[g].wall_s * g / len(samples) - sum(
            v for k, v in stage_predicted[g].items() if k not in ("ttft", "bookkeeping"))
            for g in SPLITS}
        gpu_dims = cost.preset_dims("qwen2.5-vl-7b")
        gpu_video = {} if args.gpu_frames is None else {"nframes": args.gpu_frames}
        gpu_work = sample_work(samples, gpu_dims, gpu_video)
        gpu = {world: forecast(gpu_work, gpu_dims, cost.hardware("h200"), world_size=world,
                               mode=cfg.attention.mode, answer_tokens=args.max_new_tokens)
               for world in (8, 16)}
    load_after = os.getloadavg()
    n = len(samples)
    best = {g: statistics.median(times[g]) for g in SPLITS}

    def factors(hw: Any) -> str:
        return f"{slowdown(hw, idle):.2f}x"

    rows = []
    for g in SPLITS:
        p = predicted[g]
        rows.append((g, 2 // g, f"{best[g]:.2f}", " / ".join(f"{t:.2f}" for t in times[g]),
                     f"{3600 * n / best[g]:.0f}", f"{p.wall_s:.2f}",
                     f"{p.samples_per_hour:.0f}", f"**{p.wall_s / best[g]:.2f}**",
                     f"{predicted_during[g].wall_s / best[g]:.2f}",
                     f"{predicted_idle[g].wall_s / best[g]:.2f}",
                     f"{sum(ttft[g]) / len(ttft[g]):.3f}", f"{ttft_predicted[g]:.3f}",
                     f"{statistics.median(harness[g]):.4f}", f"{outside_predicted[g]:.4f}"))
    sums = {g: [sum(r.values()) for r in stage_rows[g]] for g in SPLITS}
    stage_table: list[tuple[str, ...]] = []
    for stage in (k for k in stage_predicted[1] if k not in ("ttft", "bookkeeping")):
        measured = {g: statistics.fmean(r.get(stage, 0.0) for r in stage_rows[g]) for g in SPLITS}
        stage_table.append((stage, *(f"{measured[g]:.4f} / {stage_predicted[g][stage]:.4f}"
                                     for g in SPLITS)))
    stage_table.append(("outside the stages", *(f"{statistics.median(harness[g]):.4f} / "
                                                f"{outside_predicted[g]:.4f}" for g in SPLITS)))
    lines = [f"# apbv eval: rank groups on 2 CPU ranks ({n} LongVideoBench fixture questions)",
             "",
             f"`python benchmarks/bench_eval.py --count {args.count} --repeats {args.repeats}` "
             f"on {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
             f"tiny random model, mode {cfg.attention.mode}, {args.pixels} pixels a frame, "
             f"{args.max_new_tokens} new tokens; load average (1/5/15 min) "
             f"{'/'.join(f'{x:.1f}' for x in load_before)} before and "
             f"{'/'.join(f'{x:.1f}' for x in load_after)} after the run. Measured at the "
             f"start of the timed runs: {factors(loaded[2])} "
             f"the idle `cpu` preset's times (the mean of that and the probes after each "
             f"round of runs: {factors(during[2])}), and a collective "
             f"{1e3 * first[2]:.2f} ms on the two ranks' group and {1e3 * first[1]:.3f} ms on "
             f"a group of one (over the run: {1e3 * mean[2]:.2f} and {1e3 * mean[1]:.3f} ms; "
             f"the idle preset's {1e3 * idle.link_latency_s:.2f} ms and none); a video's "
             f"open and a frame's decoding beyond its pixels "
             + ", ".join(f"{1e3 * loaded[h].video_open_s:.2f} and "
                         f"{1e3 * loaded[h].decode_frame_s:.3f} ms on a rank of {h}"
                         for h in (2, 1))
             + " (over the run: " + ", ".join(f"{1e3 * during[h].video_open_s:.2f} and "
                                               f"{1e3 * during[h].decode_frame_s:.3f} ms"
                                               for h in (2, 1))
             + f"; the idle preset's {1e3 * idle.video_open_s:.2f} and "
             f"{1e3 * idle.decode_frame_s:.3f} ms); the harness's "
             f"seconds per sample in the prediction: {loaded[2].sample_overhead_s:.4f} "
             f"({idle.sample_overhead_s:.4f} idle) and the row's fsync "
             f"{loaded[2].sample_sync_s:.4f} (not scaled).", "",
             *_table(rows, ("G", "H", "wall s (median)", "runs s", "samples/h",
                            "predicted wall s", "predicted samples/h",
                            "predicted / measured",
                            "predicted at the run's mean load / measured",
                            "idle preset's / measured",
                            "engine TTFT s (mean)", "predicted TTFT s",
                            "harness s/sample (measured)", "predicted")),
             "",
             "Engine stages, mean seconds per sample, measured / predicted (as loaded); "
             "last, the seconds per sample outside the stages (the wall time less the "
             "stages: the request's check and the stage times' maxima, the harness, and the "
             "rounds' gathers):", "",
             *_table(stage_table, ("stage", *(f"G={g}, H={2 // g}" for g in SPLITS))),
             "", "A sample's engine seconds (the stages' sum), mean and standard deviation "
             "over the runs' samples: " + "; ".join(
                 f"G={g}: {statistics.fmean(sums[g]):.4f} and {statistics.pstdev(sums[g]):.4f}"
                 for g in SPLITS) + " (with two groups a round waits for the slower one: "
             "for two independent normal times, 0.56 standard deviations over the mean; the "
             "cost model prices the mean).",
             "", "Share of a core per rank, each probe (start, then after each round): "
             + "; ".join(", ".join(f"{p['host_share']:.3f}" for p in r["probes"])
                         for r in per_rank), "",
             f"samples per hour, (2, 1) over (1, 2): measured "
             f"{best[1] / best[2]:.2f}x, predicted "
             f"{predicted[1].wall_s / predicted[2].wall_s:.2f}x", ""]
    for world, forecasts in gpu.items():
        frames = "2 fps" if args.gpu_frames is None else f"{args.gpu_frames} frames"
        lines += [f"## Predicted: Qwen2.5-VL-7B on {world} H200 GPUs, {frames} per video "
                  f"(default pixel limits), the same {n} questions", "", "```",
                  *forecast_lines(forecasts, "h200"), "```", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
