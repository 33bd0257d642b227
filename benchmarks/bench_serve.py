"""The server under open-loop Poisson load, beside the one-shot path without a server.

    python benchmarks/bench_serve.py                          # tiny model, 2 CPU ranks
    python benchmarks/bench_serve.py --rates 0.05,0.1,0.2 --max-requests 8 --max-seconds 150

Starts ``python -m apbv serve`` (the tiny random model, 2 CPU rank actors, vision cache on),
warms it with one untimed request, then for each rate sends requests at Poisson arrival times
(open loop: an arrival does not wait for earlier answers), each rate bounded by
``--max-requests`` arrivals and ``--max-seconds`` of arrivals. A request asks about a new video
(synthetic, written before the clock starts) with probability ``--new-fraction``, otherwise it
asks another question about a video asked about before (the vision cache may hold it).
Per rate: client-side TTFT (request sent to first streamed content chunk) p50/p90/p99,
end-to-end latency, throughput (answers per second from the first arrival to the last answer),
rejections (429/503), errors, and the vision-cache hit rate reported in the ``apbv`` blocks.

Beside it, the path users take without a server: ``python -m apbv generate`` launched per
request with torchrun (2 processes): wall time from launch to the answer printed, which pays
process start, model load and the whole answer every time.

Writes ``--out``.json, .md and .png (matplotlib). Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ("What colour is the square?", "What happens at the end?",
             "Where is the square at the start?", "How many objects move?",
             "Does the background change?", "What moves fastest?")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path)


def start_server(model: Path, media: Path, port: int, args: argparse.Namespace):
    cmd = [sys.executable, "-m", "apbv", "serve", "--config", "tiny_cpu", "--model", str(model),
           "--world-size", str(args.world_size), "--port", str(port), "--media-root",
           str(media), "--vision-cache-gb", str(args.vision_cache_gb), "--max-queue",
           str(args.max_queue), *getattr(args, "serve_args", ())]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError("the server exited:\n" + "".join(log[-40:]))
        if time.monotonic() - started > 300:
            stop_server(proc)
            raise RuntimeError("the server was not ready in 300 s:\n" + "".join(log[-40:]))
        try:
            if httpx.get(base + "/health").json()["status"] == "ready":
                return proc, base, time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def ask(base: str, video: Path, question: str, max_tokens: int) -> dict[str, Any]:
    """One streamed request; client-side times from the request being sent."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    messages = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": video.as_uri()}},
        {"type": "text", "text": question}]}]
    out: dict[str, Any] = {"video": video.name, "question": question, "status": 200}
    sent = time.monotonic()
    try:
        stream = client.chat.completions.create(model="tiny-qwen2.5-vl", messages=messages,
                                                stream=True, max_tokens=max_tokens)
        for chunk in stream:
            extra = chunk.model_extra or {}
            if "error" in extra:
                out["status"] = extra["error"].get("code", 500)
                out["error"] = extra["error"].get("message")
            if chunk.choices and chunk.choices[0].delta.content and "ttft_s" not in out:
                out["ttft_s"] = time.monotonic() - sent
            if "apbv" in extra:
                out["server_ttft_s"] = extra["apbv"]["ttft_s"]
                out["seconds"] = extra["apbv"].get("seconds", {})
                out["queue_wait_s"] = extra["apbv"]["queue_wait_s"]
                out["cache_hit"] = bool(extra["apbv"].get("vision_cache_hit", False))
                out.setdefault("ttft_s", time.monotonic() - sent)  # an empty answer
    except openai.APIStatusError as exc:
        out["status"], out["error"] = exc.status_code, str(exc)[:300]
    except openai.APIError as exc:
        out["status"], out["error"] = 0, str(exc)[:300]
    out["latency_s"] = time.monotonic() - sent
    return out


def run_rate(base: str, rate: float, videos: list[Path], asked: list[Path], rng: random.Random,
             args: argparse.Namespace) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    threads: list[threading.Thread] = []
    lock = threading.Lock()
    start = time.monotonic()
    arrival = 0.0
    for i in range(args.max_requests):
        arrival += rng.expovariate(rate) if i else 0.0
        if arrival > args.max_seconds:
            break
        if asked and (rng.random() >= args.new_fraction or not videos):
            video, kind = rng.choice(asked), "repeat"
        else:
            video, kind = videos.pop(0), "new"
            asked.append(video)
        question = rng.choice(QUESTIONS)
        time.sleep(max(0.0, start + arrival - time.monotonic()))

        def work(video: Path = video, question: str = question, kind: str = kind,
                 at: float = arrival) -> None:
            result = ask(base, video, question, args.max_tokens)
            result.update(kind=kind, arrival_s=at, done_s=time.monotonic() - start)
            with lock:
                results.append(result)

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(timeout=900)
    return summarize(rate, results)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(rate: float, results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if r["status"] == 200 and "ttft_s" in r]
    ttft = [r["ttft_s"] for r in ok]
    latency = [r["latency_s"] for r in ok]
    span = max((r["done_s"] for r in ok), default=0.0)
    repeats = [r for r in ok if r["kind"] == "repeat"]
    return {
        "rate": rate, "sent": len(results), "ok": len(ok),
        "rejected": sum(r["status"] in (429, 503) for r in results),
        "errors": sum(r["status"] not in (200, 429, 503) for r in results),
        "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90), "ttft_p99_s": _pct(ttft, 99),
        "latency_p50_s": _pct(latency, 50),
        "server_ttft_p50_s": _pct([r["server_ttft_s"] for r in ok], 50),
        "queue_wait_p50_s": _pct([r["queue_wait_s"] for r in ok], 50),
        "throughput_rps": len(ok) / span if span else 0.0,
        "cache_hit_rate": sum(r["cache_hit"] for r in ok) / len(ok) if ok else None,
        "repeats": len(repeats),
        "repeat_hit_rate": sum(r["cache_hit"] for r in repeats) / len(repeats)
        if repeats else None,
        "requests": sorted(results, key=lambda r: r["arrival_s"]),
    }


def cache_ratio(rates: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Repeat questions that hit the vision cache against first questions on a new video, over
    the rates without queueing (queue wait p50 under 10 ms): median server TTFT of each, their
    ratio, and the repeats' median preprocess + vision seconds when the server reported them."""
    calm = [r for r in rates if (r["queue_wait_p50_s"] or 0.0) < 0.01]
    done = [q for r in calm for q in r["requests"] if q["status"] == 200 and "ttft_s" in q]
    hits = [q for q in done if q["kind"] == "repeat" and q["cache_hit"]]
    new = [q for q in done if q["kind"] == "new" and not q["cache_hit"]]
    if not hits or not new:
        return None
    out = {"rates": [r["rate"] for r in calm], "hits": len(hits), "new": len(new),
           "hit_ttft_p50_s": float(np.median([q["server_ttft_s"] for q in hits])),
           "new_ttft_p50_s": float(np.median([q["server_ttft_s"] for q in new]))}
    out["ratio"] = out["hit_ttft_p50_s"] / out["new_ttft_p50_s"]
    staged = [q["seconds"] for q in hits if q.get("seconds")]
    if staged:
        out["hit_preprocess_vision_p50_s"] = float(np.median(
            [s.get("preprocess", 0.0) + s.get("vision", 0.0) for s in staged]))
    return out


def one_shot(model: Path, video: Path, question: str, args: argparse.Namespace) -> dict:
    """``python -m apbv generate`` under torchrun: launch to answer, wall time."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.world_size}", "-m", "apbv", "generate", "--config",
           "tiny_cpu", "--model", str(model), "--video", str(video), "--question", question,
           "--max-new-tokens", str(args.max_tokens), "--json"]
    env = dict(_env(), OMP_NUM_THREADS="1")
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - started
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    inner = json.loads(lines[-1]).get("ttft_s") if lines else None
    return {"video": video.name, "rc": proc.returncode, "wall_s": wall, "engine_ttft_s": inner,
            "stderr_tail": proc.stderr[-300:] if proc.returncode else ""}


def write_markdown(path: Path, report: dict[str, Any]) -> None:
    def f(x: float | None, digits: int = 2) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    rows = ["| rate (req/s) | sent | ok | rejected | errors | TTFT p50 (s) | TTFT p90 (s) | "
            "TTFT p99 (s) | latency p50 (s) | queue wait p50 (s) | throughput (req/s) | "
            "cache hits | hits on repeats |", "|" + "---|" * 13]
    for r in report["rates"]:
        rows.append(f"| {r['rate']:g} | {r['sent']} | {r['ok']} | {r['rejected']} | "
                    f"{r['errors']} | {f(r['ttft_p50_s'])} | {f(r['ttft_p90_s'])} | "
                    f"{f(r['ttft_p99_s'])} | {f(r['latency_p50_s'])} | "
                    f"{f(r['queue_wait_p50_s'])} | {f(r['throughput_rps'], 3)} | "
                    f"{f(r['cache_hit_rate'])} | {f(r['repeat_hit_rate'])} |")
    shots = [s["wall_s"] for s in report["one_shot"] if s["rc"] == 0]
    text = [f"# Serving on CPU: {report['world_size']} ranks, tiny model", "",
            f"Machine: {report['machine']}. Server ready after {report['startup_s']:.1f} s "
            "(Ray, actors, model load: paid once).", "",
            f"`{report.get('command', 'python benchmarks/bench_serve.py')}`", "", *rows, ""]
    if shots:
        text += [f"One-shot `python -m apbv generate` under torchrun ({report['world_size']} "
                 f"procs), launch to answer, {len(shots)} requests: median "
                 f"{np.median(shots):.2f} s (min {min(shots):.2f}, max {max(shots):.2f}); "
                 "engine TTFT inside it: "
                 + ", ".join(f(s["engine_ttft_s"]) for s in report["one_shot"]) + " s.", ""]
    ratio = cache_ratio(report["rates"])
    if ratio:
        staged = ratio.get("hit_preprocess_vision_p50_s")
        calm = ", ".join(f"{r:g}" for r in ratio["rates"])
        text += [f"Vision cache, at the rates without queueing ({calm} req/s): a repeat "
                 "question that hit the cache has a server TTFT p50 of "
                 f"{ratio['hit_ttft_p50_s']:.2f} s against {ratio['new_ttft_p50_s']:.2f} s for a "
                 f"first question on a new video ({ratio['hits']} and {ratio['new']} requests): "
                 f"**{ratio['ratio']:.2f}x**"
                 + (f"; preprocess + vision on a hit: {staged * 1000:.0f} ms (p50)."
                    if staged is not None else "."), ""]
    text += ["TTFT is client-side: request sent to the first streamed content chunk. Each rate "
             "is a handful of requests, so p90/p99 are close to the maximum; the machine is a "
             "shared 2-core VM, so numbers are noisy. " + report["notes"]]
    path.write_text("\n".join(text) + "\n")


def plot(path: Path, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["rate"] for r in report["rates"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("ttft_p50_s", "p50"), ("ttft_p90_s", "p90"), ("ttft_p99_s", "p99")):
        left.plot(rates, [r[key] for r in report["rates"]], "o-", label=f"server TTFT {label}")
    shots = [s["wall_s"] for s in report["one_shot"] if s["rc"] == 0]
    if shots:
        left.axhline(float(np.median(shots)), color="k", ls="--",
                     label="one-shot torchrun, launch to answer (median)")
    left.set_xlabel("offered load (req/s)")
    left.set_ylabel("seconds")
    left.set_yscale("log")
    left.set_title("Time to first token")
    left.legend(fontsize=8, loc="center right")
    right.plot(rates, [r["throughput_rps"] for r in report["rates"]], "o-", label="served")
    right.plot(rates, rates, ":", color="gray", label="offered")
    right.set_xlabel("offered load (req/s)")
    right.set_ylabel("answers per second")
    right.set_title("Throughput")
    right.legend(fontsize=8)
    fig.suptitle(f"apbv serve, tiny model, {report['world_size']} CPU ranks ({report['machine']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="0.05,0.1,0.2", help="arrival rates in req/s")
    p.add_argument("--max-requests", type=int, default=8, help="arrivals per rate at most")
    p.add_argument("--max-seconds", type=float, default=150, help="arrival window per rate")
    p.add_argument("--new-fraction", type=float, default=0.5, help="share of new videos")
    p.add_argument("--one-shot", type=int, default=3, help="torchrun one-shot requests")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=16)
    p.add_argument("--vision-cache-gb", type=float, default=0.25)
    p.add_argument("--video-seconds", type=float, default=20.0)
    p.add_argument("--video-size", type=int, default=112, help="square frame side in pixels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--notes", default="", help="free text for the report")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/serve_cpu"),
                   help="output path without suffix")
    p.add_argument("--render", metavar="JSON",
                   help="only rewrite the markdown and plot of an earlier run's JSON")
    args = p.parse_args()
    if args.render:
        report = json.loads(Path(args.render).read_text())
        out = Path(args.render).with_suffix("")
        write_markdown(out.with_suffix(".md"), report)
        plot(out.with_suffix(".png"), report)
        print(out.with_suffix(".md").read_text())
        return 0
    from apbv.model.qwen2_5_vl.tiny import write_tiny_checkpoint
    from apbv.synthetic.videos import write_test_video

    rates = [float(r) for r in args.rates.split(",")]
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_checkpoint(Path(tmp) / "tiny-qwen2.5-vl")
        media = Path(tmp) / "media"
        media.mkdir()
        count = args.max_requests * len(rates) + args.one_shot + 1
        videos = [write_test_video(media / f"v{i:03d}.mp4", fps=4.0, seed=100 + i,
                                   num_frames=int(args.video_seconds * 4),
                                   width=args.video_size, height=args.video_size)
                  for i in range(count)]
        shots = [one_shot(model, videos.pop(), QUESTIONS[i % len(QUESTIONS)], args)
                 for i in range(args.one_shot)]
        print("one-shot:", [f"{s['wall_s']:.1f}s rc={s['rc']}" for s in shots], flush=True)
        proc, base, startup = start_server(model, media, _free_port(), args)
        try:
            warm = ask(base, videos.pop(), QUESTIONS[0], args.max_tokens)
            print(f"server ready in {startup:.1f}s; warm-up {warm['latency_s']:.1f}s", flush=True)
            asked: list[Path] = []
            results = []
            for rate in rates:
                results.append(run_rate(base, rate, videos, asked, rng, args))
                r = results[-1]
                print(f"rate {rate:g}: ok {r['ok']}/{r['sent']}, TTFT p50 {r['ttft_p50_s']}, "
                      f"hits {r['cache_hit_rate']}", flush=True)
        finally:
            stop_server(proc)
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "world_size": args.world_size, "startup_s": startup,
              "args": {**vars(args), "out": Path(args.out).name},
              "command": "python benchmarks/bench_serve.py " + " ".join(sys.argv[1:]),
              "notes": args.notes, "rates": results, "one_shot": shots}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    write_markdown(out.with_suffix(".md"), report)
    plot(out.with_suffix(".png"), report)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
