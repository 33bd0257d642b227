"""A live stream against one-shot prefill on the same frames, measured side by side in one run.

    python benchmarks/bench_stream.py                        # tiny random model, 2 CPU ranks
    python benchmarks/bench_stream.py --minutes 1,5 --window-minutes 2

One stream of synthetic frames at ``--fps`` (2) is appended ``--chunk-frames`` (4: 2 s of
video) at a time on ``--world-size`` gloo ranks (one thread each). When the video reaches each
``--minutes`` mark the stream is asked the question (best ``ask`` TTFT of ``--repeats``), and
the same frames go through one-shot ``spava`` and one-shot ``exact``
(``Request(video=DecodedVideo(frames, fps))``), on the same ranks and engine. Printed per mark:

- ask TTFT and its ratio to one-shot spava and exact TTFT;
- ingest: frames per second of append time (what one group sustains), and the lag a live
  source at ``--fps`` would see: appends (and asks) queue behind real time, the lag is how far
  after its last frame's time the latest append finished (0 while ingest keeps up);
- KV: the largest per-rank KV cache (``Result.kv_cache_bytes_max``) and tokens per rank;
- whether ask's tokens equal one-shot exact's (they should: nothing is evicted).

Then a windowed stream (``--window-minutes`` window over ``2x`` that much video) prints each
rank's KV bytes every 10 s of video: flat once the window is full.

Frames: :func:`apbv.synthetic.videos.make_frame` generated in memory at 112x112 (16 LLM tokens per
2 frames: 20 minutes is 19,200 video tokens, which a CPU one-shot exact prefill still does in
seconds; the stream's cost per frame does not depend on the frame size beyond the vision
tower). Output: ``--out`` STEM.json, STEM.md and STEM.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import add_model_args, model_dir, pyplot, save_figure

from apbv.config import RuntimeConfig, load_config
from apbv.distributed import DistInfo, spawn_local

QUESTION = "What colour is the square in the last second?"


def _frames(count: int, fps: float, size: int) -> torch.Tensor:
    from apbv.synthetic.videos import make_frame

    return torch.stack([torch.from_numpy(make_frame(i, fps=fps, width=size, height=size))
                        .permute(2, 0, 1).contiguous() for i in range(count)])


def _oneshot(engine: Any, frames: torch.Tensor, fps: float, mode: str, tokens: int) -> Any:
    from apbv.engine.request import Request
    from apbv.video import DecodedVideo

    return engine.generate(Request(video=DecodedVideo(frames, fps), question=QUESTION,
                                   mode=mode, max_new_tokens=tokens))


def _log(info: DistInfo, text: str) -> None:
    if info.rank == 0:
        print(text, file=sys.stderr, flush=True)


def _rank_job(info: DistInfo, cfg: RuntimeConfig, opts: dict[str, Any]) -> dict[str, Any]:
    from apbv.engine.engine import Engine
    from apbv.engine.request import Request, StreamRef
    from apbv.engine.stream_plan import StreamSpec

    engine = Engine(cfg, info)

    def ask(stream_id: str):  # over the stream's held KV: exact attention
        return engine.generate(Request.from_config(cfg, StreamRef(stream_id), QUESTION,
                                                   mode="exact", max_new_tokens=tokens))

    fps, size, chunk, tokens = opts["fps"], opts["size"], opts["chunk_frames"], opts["tokens"]
    marks = [round(m * 60 * fps) for m in opts["minutes"]]
    window_frames = round(2 * opts["window_minutes"] * 60 * fps)
    frames = _frames(max(marks + [window_frames]), fps, size)
    stamps = [i / fps for i in range(len(frames))]

    engine.open_stream("warm", StreamSpec(size, size, fps=fps))  # warm-up, untimed
    engine.append("warm", frames[:4], stamps[:4])
    ask("warm")
    engine.close_stream("warm")
    for mode in ("spava", "exact"):
        _oneshot(engine, frames[:8], fps, mode, tokens)

    engine.open_stream("stream", StreamSpec(size, size, fps=fps))
    appends: list[float] = []  # wall seconds of each append (they end in a collective)
    done = 0.0  # when the simulated live group finishes its latest work (video seconds)
    lag_max = 0.0
    rows = []
    start = 0
    for mark in marks:
        seg_t0, seg_appends = len(appends), 0.0
        while start < mark:
            end = min(start + chunk, mark)
            t = time.perf_counter()
            engine.append("stream", frames[start:end], stamps[start:end])
            d = time.perf_counter() - t
            appends.append(d)
            seg_appends += d
            arrive = stamps[end - 1] + 1 / fps  # the chunk is complete one frame period later
            done = max(done, arrive) + d
            lag_max = max(lag_max, done - arrive)
            start = end
        best, ask_wall = None, 0.0
        for _ in range(opts["repeats"]):
            t = time.perf_counter()
            result = ask("stream")
            ask_wall = time.perf_counter() - t
            if best is None or result.ttft_s < best.ttft_s:
                best = result
        done += ask_wall  # one ask per mark delays the live group
        arrive = stamps[mark - 1] + 1 / fps
        lag = max(0.0, done - arrive)
        lag_max = max(lag_max, lag)
        held = best.frames
        _log(info, f"[bench] {mark / fps / 60:g} min: ask TTFT {best.ttft_s:.4f} s; one-shot...")
        spava = _oneshot(engine, frames[:held], fps, "spava", tokens)
        exact = _oneshot(engine, frames[:held], fps, "exact", tokens)
        described = dataclasses.asdict(engine.describe_stream("stream"))
        total_append = sum(appends)
        rows.append({
            "minutes": mark / fps / 60, "frames": held,
            "video_tokens": sum(described["video_tokens_per_rank"]),
            "ask_ttft_s": best.ttft_s, "ask_seconds": best.seconds,
            "spava_ttft_s": spava.ttft_s, "exact_ttft_s": exact.ttft_s,
            "ask_over_spava": best.ttft_s / spava.ttft_s,
            "ask_over_exact": best.ttft_s / exact.ttft_s,
            "ask_tokens": best.token_ids, "exact_tokens": exact.token_ids,
            "spava_tokens": spava.token_ids,
            "ask_equals_exact": best.token_ids == exact.token_ids,
            "ingest_fps": mark / total_append,
            "ingest_fps_segment": (mark - (marks[len(rows) - 1] if rows else 0)) / seg_appends,
            "append_s_total": total_append, "appends": len(appends),
            "append_s_mean": total_append / len(appends),
            "append_s_last": sum(appends[seg_t0:][-10:]) / len(appends[seg_t0:][-10:]),
            "append_s_max": max(appends), "ask_wall_s": ask_wall,
            "append_stage_s": described["seconds"],
            "lag_s": lag, "lag_max_s": lag_max,
            "kv_bytes_max_stream": best.kv_cache_bytes_max,
            "kv_bytes_max_spava": spava.kv_cache_bytes_max,
            "kv_bytes_max_exact": exact.kv_cache_bytes_max,
            "tokens_per_rank": described["tokens_per_rank"],
        })
        _log(info, f"[bench] {rows[-1]['minutes']:g} min: spava {spava.ttft_s:.3f} s, exact "
                   f"{exact.ttft_s:.3f} s, ingest {rows[-1]['ingest_fps']:.1f} fps, lag "
                   f"{lag:.2f} s")
    engine.close_stream("stream")

    engine.open_stream("windowed", StreamSpec(size, size, fps=fps,
                                              window_s=opts["window_minutes"] * 60))
    series = []
    every = round(10 * fps)  # a sample every 10 s of video
    for s in range(0, window_frames, chunk):
        e = min(s + chunk, window_frames)
        engine.append("windowed", frames[s:e], stamps[s:e])
        if e % every == 0:
            d = dataclasses.asdict(engine.describe_stream("windowed"))
            series.append({"video_s": e / fps,
                           "kv_bytes": engine.streams["windowed"].cache.nbytes(),
                           "tokens_per_rank": d["tokens_per_rank"],
                           "chunks_evicted": d["chunks_evicted"],
                           "seconds_held": d["seconds_held"]})
    result = ask("windowed")
    engine.close_stream("windowed")
    return {"rows": rows, "window": series, "window_ask_kv_bytes_max": result.kv_cache_bytes_max}


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="apbv-bench-") as tmp:
        model = model_dir(args, Path(tmp))
        cfg = load_config(args.config, [f"model.path={model!r}",
                                        f"parallel.timeout_s={args.timeout}"])
        opts = {"fps": args.fps, "size": args.frame_size, "chunk_frames": args.chunk_frames,
                "tokens": args.max_new_tokens, "repeats": args.repeats,
                "minutes": [float(m) for m in args.minutes.split(",")],
                "window_minutes": args.window_minutes}
        per_rank = spawn_local(_rank_job, args.world_size, (cfg, opts), timeout_s=7200,
                               collective_timeout_s=args.timeout)
    out = per_rank[0]
    out["window"] = [{**point, "kv_bytes_per_rank": [r["window"][i]["kv_bytes"]
                                                     for r in per_rank]}
                     for i, point in enumerate(out["window"])]
    for point in out["window"]:
        del point["kv_bytes"]
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| video | frames | video tokens | ask TTFT s | spava TTFT s | exact TTFT s | "
        "ask / spava | ask / exact | ask = exact | ingest fps | lag s | KV MiB/rank "
        "(stream) | KV MiB/rank (spava) | tokens per rank |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['minutes']:g} min | {r['frames']} | {r['video_tokens']} | "
            f"{r['ask_ttft_s']:.4f} | {r['spava_ttft_s']:.3f} | {r['exact_ttft_s']:.3f} | "
            f"{r['ask_over_spava']:.3f} | {r['ask_over_exact']:.3f} | "
            f"{'yes' if r['ask_equals_exact'] else 'no'} | {r['ingest_fps']:.1f} | "
            f"{r['lag_s']:.2f} | {_mib(r['kv_bytes_max_stream'])} | "
            f"{_mib(r['kv_bytes_max_spava'])} | {r['tokens_per_rank']} |")
    lines += ["", f"Windowed stream ({report['meta']['window_minutes']:g} min window), KV "
                  "bytes per rank every 10 s of video:", "",
              "| video s | KV MiB per rank | tokens per rank | chunks evicted |",
              "|---:|---|---|---:|"]
    for p in report["window"]:
        lines.append(f"| {p['video_s']:g} | {[_mib(b) for b in p['kv_bytes_per_rank']]} | "
                     f"{p['tokens_per_rank']} | {p['chunks_evicted']} |")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False

    rows = report["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    minutes = [r["minutes"] for r in rows]
    for key, label in (("ask_ttft_s", "stream ask"), ("spava_ttft_s", "one-shot spava"),
                       ("exact_ttft_s", "one-shot exact")):
        left.plot(minutes, [r[key] for r in rows], marker="o", label=label)
    left.set(xlabel="video minutes (2 fps)", ylabel="TTFT (s)", yscale="log",
             title="time to first token on the same frames")
    window = report["window"]
    for rank in range(len(window[0]["kv_bytes_per_rank"]) if window else 0):
        right.plot([p["video_s"] for p in window],
                   [p["kv_bytes_per_rank"][rank] / 2**20 for p in window], marker=".",
                   label=f"rank {rank}")
    right.set(xlabel="video seconds", ylabel="KV MiB",
              title=f"windowed stream ({report['meta']['window_minutes']:g} min window)")
    return save_figure(fig, path, styled=(left, right))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--config", default="tiny_cpu", help="config preset")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--minutes", default="1,5,10,20", help="ask marks, comma-separated")
    parser.add_argument("--fps", type=float, default=2.0)
    parser.add_argument("--frame-size", type=int, default=112, help="square frames (x28)")
    parser.add_argument("--chunk-frames", type=int, default=4, help="frames per append")
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="asks per mark (best kept)")
    parser.add_argument("--window-minutes", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=600.0, help="collective timeout (s)")
    parser.add_argument("--out", default="benchmarks/results/stream_cpu",
                        help="output stem: writes STEM.json, STEM.md and STEM.png")
    args = parser.parse_args(argv)
    wall = time.perf_counter()
    report = run(args)
    report["meta"] = {"torch": torch.__version__, "machine": platform.machine(),
                      "ranks": args.world_size, "model": args.model or f"random {args.size}",
                      "fps": args.fps, "frame_size": args.frame_size,
                      "chunk_frames": args.chunk_frames, "window_minutes": args.window_minutes,
                      "wall_s": time.perf_counter() - wall}
    stem = Path(args.out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    table = markdown(report)
    stem.with_suffix(".md").write_text(table + "\n")
    print(table)
    for r in report["rows"]:
        keeps = r["ingest_fps"] >= args.fps and r["lag_s"] < 2 * args.chunk_frames / args.fps
        print(f"{r['minutes']:g} min: ask/spava {r['ask_over_spava']:.4f} "
              f"(target <= 0.05: {'met' if r['ask_over_spava'] <= 0.05 else 'NOT met'}), "
              f"ask/exact {r['ask_over_exact']:.4f}; ingest {r['ingest_fps']:.1f} fps "
              f"sustained (needs {args.fps:g}: {'keeps up' if keeps else 'falls behind'}), "
              f"lag {r['lag_s']:.2f} s; append stages {r['append_stage_s']}")
    kv = [max(p["kv_bytes_per_rank"]) for p in report["window"]]
    full = [p["kv_bytes_per_rank"] for p in report["window"]
            if p["video_s"] >= args.window_minutes * 60]
    print("windowed KV bytes per rank every 10 s:", [p["kv_bytes_per_rank"]
                                                      for p in report["window"]])
    if full:
        flat = max(max(b) for b in full) / max(1, min(min(b) for b in full))
        print(f"window full: max/min per-rank KV bytes {flat:.3f} (flat when close to 1); "
              f"peak {max(kv)} bytes")
    plotted = plot(report, stem.with_suffix(".png"))
    print(json.dumps({"benchmark": "bench_stream", **report["meta"],
                      "json": str(stem.with_suffix(".json")),
                      "plot": str(stem.with_suffix(".png")) if plotted else None}))


if __name__ == "__main__":
    main()
