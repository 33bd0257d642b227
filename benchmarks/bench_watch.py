"""Standing questions on K live cameras: detection latency, recall and false alerts of watches,
beside the loop a user builds without them (a one-shot ``choices`` ask every 2 s per camera).

    python benchmarks/bench_watch.py                        # K = 1, 2, 4, 8; 40 s each
    python benchmarks/bench_watch.py --cameras 2,4 --seconds 60

Starts ``python -m apbv serve`` (the trained tiny model, 2 CPU rank actors). Per K, twice:

- **watch**: K pushed streams (56x56 frames at 2 fps, pushed in real time one temporal patch,
  2 frames, per second, each camera at its own phase of the second), each with one standing
  question ("What colour is the flash?", the 8 colours, rule ``change``); one flash of a
  random colour (not cyan: the tiny model's answer before any flash) at a random second in
  the middle; events read from ``GET /v1/events``.
- **baseline**: the same cameras without watches; per camera a client asks the same question
  with ``choices`` every 2 s as a one-shot prefill of the last 30 s (``"fresh": true`` over a
  30 s window: a ``spava`` prefill from the kept vision embeddings, so the vision tower is not
  re-run: a lower bound on a one-shot request's cost).

Detection latency: from sending the push that holds the flash to receiving the event (or the
first answer naming the flash's colour), client clocks. Recall: flashes detected within 10 s.
False alerts: events (answers) naming a colour other than the flash's, or before it, per
camera-hour. Evaluation lag: the largest ``watches.lag_s`` seen in the streams' stats.
The presence question of the issue is not asked: the shipped tiny model was not trained on
one. Writes ``--out``.json, .md and .png. Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import platform
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from bench_serve import _free_port, start_server, stop_server
from common import pyplot, save_figure

ROOT = Path(__file__).resolve().parents[1]
NEEDLE_TINY = ROOT / "apbv" / "assets" / "needle-tiny"
QUESTION = "What colour is the flash?"
DETECT_S = 10.0


def _png(pixels: np.ndarray) -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def _second(rng: np.random.Generator, colour: str | None) -> list[str]:
    """One temporal patch (2 identical frames): noise, or the flash of ``colour``."""
    from apbv.synthetic.needles import COLOURS, FRAME_SIZE

    if colour is None:
        image = rng.integers(0, 256, (FRAME_SIZE, FRAME_SIZE, 3), dtype=np.uint8)
    else:
        image = np.full((FRAME_SIZE, FRAME_SIZE, 3), COLOURS[colour], dtype=np.uint8)
    return [_png(image)] * 2


class _Events(threading.Thread):
    def __init__(self, base: str):
        super().__init__(daemon=True)
        self.base, self.got, self.stop = base, [], threading.Event()

    def run(self) -> None:
        with httpx.stream("GET", self.base + "/v1/events", timeout=None) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.got.append((time.monotonic(), json.loads(line[6:])))
                if self.stop.is_set():
                    return


def run_k(base: str, k: int, seconds: int, baseline: bool, seed: int) -> dict[str, Any]:
    from apbv.synthetic.needles import COLOURS

    colours = [c for c in COLOURS if c != "cyan"]
    rng = random.Random(seed)
    api = httpx.Client(base_url=base + "/v1", timeout=120)
    cams = []
    for _ in range(k):
        sid = api.post("/streams", json={"fps": 2, "width": 56, "height": 56, "min_pixels": 3136,
                                         "max_pixels": 3136, "window_s": 30,
                                         "keep_vision": baseline}).json()["id"]
        cams.append({"id": sid, "flash_at": rng.randint(seconds // 3, 2 * seconds // 3),
                     "colour": rng.choice(colours), "sent": None, "answers": [], "lag": 0.0})
    events = _Events(base)
    events.start()
    start = time.monotonic() + 1.0

    def camera(cam: dict, index: int) -> None:
        frames = np.random.default_rng([seed, index])
        offset = index / k  # cameras are not in step: each pushes at its own phase
        for s in range(seconds):
            time.sleep(max(0.0, start + offset + s - time.monotonic()))
            flash = cam["colour"] if s == cam["flash_at"] else None
            sent = time.monotonic()
            api.post(f"/streams/{cam['id']}/frames", json={"frames": _second(frames, flash)})
            if flash:
                cam["sent"] = sent
            if s == 1 and not baseline:  # the watch, once the stream holds frames
                api.post(f"/streams/{cam['id']}/watches",
                         json={"question": QUESTION, "choices": list(COLOURS)})
            if s % 2 == 1:
                stats = api.get(f"/streams/{cam['id']}").json().get("watches", {})
                cam["lag"] = max(cam["lag"], stats.get("lag_s") or 0.0)

    def asker(cam: dict) -> None:
        for s in range(2, seconds + int(DETECT_S), 2):
            time.sleep(max(0.0, start + s - time.monotonic()))
            out = api.post(f"/streams/{cam['id']}/ask", json={
                "question": QUESTION, "choices": list(COLOURS), "fresh": True}).json()
            if "choices" in out:
                cam["answers"].append((time.monotonic(),
                                       out["choices"][0]["message"]["content"]))

    threads = [threading.Thread(target=camera, args=(c, i)) for i, c in enumerate(cams)]
    if baseline:
        threads += [threading.Thread(target=asker, args=(c,)) for c in cams]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(DETECT_S if not baseline else 0.0)
    events.stop.set()
    latencies, detected, false = [], 0, 0
    for cam in cams:
        if baseline:
            seen = [(t, a) for t, a in cam["answers"] if a != "cyan"]
        else:
            seen = [(t, e["answer"]) for t, e in events.got if e["stream"] == cam["id"]]
        hit = next((t for t, a in seen if a == cam["colour"] and cam["sent"] is not None
                    and t >= cam["sent"]), None)
        if hit is not None and hit - cam["sent"] <= DETECT_S:
            detected += 1
            latencies.append(hit - cam["sent"])
        false += sum(1 for t, a in seen if a != cam["colour"] or
                     (cam["sent"] is not None and t < cam["sent"]))
        api.delete(f"/streams/{cam['id']}")
    hours = k * seconds / 3600

    def pct(q: float) -> float | None:
        return float(np.percentile(latencies, q)) if latencies else None
    return {"k": k, "path": "baseline" if baseline else "watch", "seconds": seconds,
            "recall": detected / k, "p50_s": pct(50), "p95_s": pct(95),
            "false_alerts_per_camera_hour": false / hours, "false_alerts": false,
            "max_eval_lag_s": None if baseline else max(c["lag"] for c in cams)}


def write_markdown(path: Path, report: dict[str, Any]) -> None:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [f"# Standing questions on K cameras ({report['machine']})", "",
             f"Trained tiny model, {report['world_size']} CPU ranks, {report['seconds']} s of "
             "2 fps footage per camera, one flash each; `python benchmarks/bench_watch.py`.", "",
             "| K | path | recall | p50 latency (s) | p95 latency (s) | false alerts / camera-h "
             "| max evaluation lag (s) |", "|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        lines.append(f"| {r['k']} | {r['path']} | {r['recall']:.2f} | {f(r['p50_s'])} | "
                     f"{f(r['p95_s'])} | {r['false_alerts_per_camera_hour']:.0f} | "
                     f"{f(r['max_eval_lag_s'])} |")
    lines += ["", f"Largest K sustained by watches (recall >= 0.9, p95 <= 2 s): "
                  f"{report['sustained_k']}", ""]
    path.write_text("\n".join(lines))


def plot(path: Path, report: dict[str, Any]) -> None:
    """p95 detection latency and recall against K, watches beside the baseline."""
    plt = pyplot()
    if plt is None:
        return
    fig, (lat, rec) = plt.subplots(1, 2, figsize=(9, 3.5))
    for name in ("watch", "baseline"):
        runs = [r for r in report["runs"] if r["path"] == name]
        ks = [r["k"] for r in runs]
        lat.plot(ks, [r["p95_s"] if r["p95_s"] is not None else float("nan") for r in runs],
                 "o-", label=name)
        rec.plot(ks, [r["recall"] for r in runs], "o-", label=name)
    lat.axhline(2.0, color="grey", ls=":", label="2 s")
    lat.set(xlabel="cameras K", ylabel="p95 flash -> event (s)", xscale="log", xticks=[])
    rec.set(xlabel="cameras K", ylabel="recall", ylim=(0, 1.05), xscale="log")
    for ax in (lat, rec):
        ax.set_xticks(sorted({r["k"] for r in report["runs"]}))
        ax.get_xaxis().set_major_formatter(plt.ScalarFormatter())
        ax.minorticks_off()
    save_figure(fig, path, styled=(lat, rec))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cameras", default="1,2,4,8", help="the K to run, comma-separated")
    p.add_argument("--seconds", type=int, default=40, help="footage per camera per run")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "watch_cpu"))
    args = p.parse_args()
    if args.seconds < 12:
        raise SystemExit("--seconds must be >= 12 (the flash falls in the middle third)")
    ks = [int(k) for k in args.cameras.split(",")]
    serve = argparse.Namespace(world_size=args.world_size, vision_cache_gb=0, max_queue=64)
    with tempfile.TemporaryDirectory() as media:
        proc, base, _ = start_server(NEEDLE_TINY, Path(media), _free_port(), serve)
        try:
            runs = []
            for k in ks:
                for baseline in (False, True):
                    runs.append(run_k(base, k, args.seconds, baseline, args.seed + k))
                    print(json.dumps(runs[-1]), flush=True)
        finally:
            stop_server(proc)
    good = [r["k"] for r in runs if r["path"] == "watch" and r["recall"] >= 0.9
            and r["p95_s"] is not None and r["p95_s"] <= 2.0]
    report = {"machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
              "world_size": args.world_size, "seconds": args.seconds, "runs": runs,
              "sustained_k": max(good) if good else None}
    Path(args.out + ".json").write_text(json.dumps(report, indent=2))
    write_markdown(Path(args.out + ".md"), report)
    plot(Path(args.out + ".png"), report)
    print(Path(args.out + ".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
