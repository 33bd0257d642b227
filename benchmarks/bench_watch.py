"""Standing questions on K live cameras: detection latency, recall and false alerts of watches,
beside the loop a user builds without them (a one-shot ``choices`` ask every 2 s per camera).

    python benchmarks/bench_watch.py                        # K = 1 .. 16; 40 s each
    python benchmarks/bench_watch.py --cameras 2,4 --seconds 60
    python benchmarks/bench_watch.py --cameras 8 --paths watch \
        --presence-question "Is there a flash?"

Starts ``python -m apbv serve`` (the trained tiny model, 2 CPU rank actors). Per K, twice:

- **watch**: K pushed streams (56x56 frames at 2 fps, pushed in real time one temporal patch,
  2 frames, per second, each camera at its own phase of the second), each with one standing
  question ("What colour is the flash?", the 8 colours, rule ``change``); one flash of a
  random colour (not cyan: the previous tiny model's answer before any flash) at a random second in
  the middle; events read from ``GET /v1/events``.
- **baseline**: the same cameras without watches; per camera a client asks the same question
  with ``choices`` every 2 s as a one-shot prefill of the last 30 s (``"fresh": true`` over a
  30 s window: a ``spava`` prefill from the kept vision embeddings, so the vision tower is not
  re-run: a lower bound on a one-shot request's cost).

Detection latency: from sending the push that holds the flash to receiving the event (or the
first answer naming the flash's colour), client clocks. Recall: flashes detected within 10 s.
False alerts: events (answers) naming a colour other than the flash's, or before it, per
camera-hour. Evaluation lag: the largest ``watches.lag_s`` seen in the streams' stats. Where
the latency goes: the mean over the detecting events of their ``stages`` (the append's seconds
queued and on the ranks, the evaluation's the same; the rest is the push's HTTP, the wait for
the stream's earlier evaluation and the event's delivery).

``--presence-question`` (e.g. "Is there a flash?") adds a second watch per camera with choices
yes / no, scored apart (detected: a "yes" event after the flash; false: a "yes" before it);
by default it is not asked (a model trained on that question answers it). ``--presence-only``
watches that question alone.

Static cameras (``--footage static``): each camera films a fixed scene
(:func:`apbv.video.footage.camera_frame`'s textured background and timestamp overlay, under a
fixed high-frequency texture of ``--texture`` weight: the tiny model knows flash-free frames
as noise) with Gaussian sensor noise of ``--noise`` grey levels on every frame, and the flash
is the whole frame in its colour for one second. ``--thresholds 0,8`` runs each K with
temporal pruning off (0) and at 8 levels (``static_threshold`` at the stream's open), side by
side in one run: a pruned stream's unchanged pushes add no tokens and its watches reuse their
answer. A camera whose stream the server refuses (its time budget) counts as missed; a refused
watch is asked again each second, as a client retries a 429, until the second before the flash
(the cameras start together, so the first ones' watches meet the others' start-up appends:
a stream's first append stands for its load until its second is measured).
Writes ``--out``.json, .md and .png. Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import platform
import random
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Callable
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


def _rgb(planes: np.ndarray, side: int) -> np.ndarray:
    """float32 (side, side, 3) RGB of yuv420p ``planes`` (BT.601, full range)."""
    y = planes[:side].astype(np.float32)
    quarter = side * side // 4
    u, v = (planes[side:].reshape(-1)[i * quarter:(i + 1) * quarter]
            .reshape(side // 2, side // 2).repeat(2, 0).repeat(2, 1).astype(np.float32) - 128
            for i in (0, 1))
    return np.stack([y + 1.402 * v, y - 0.344 * u - 0.714 * v, y + 1.772 * u], -1)


class StaticCamera:
    """A fixed camera's frames at 2 fps (see the module docstring): ``second(s, colour)`` is
    second ``s``'s temporal patch (2 frames, each with its own sensor noise), or the flash of
    ``colour``."""

    def __init__(self, seed: int, noise: float, texture: float):
        from apbv.synthetic.needles import FRAME_SIZE
        from apbv.video.footage import _background

        self.seed, self.noise, self.side = seed, noise, FRAME_SIZE
        self.background = _background(FRAME_SIZE, FRAME_SIZE, seed)
        pattern = np.random.default_rng([seed, 1]).integers(0, 256, (FRAME_SIZE, FRAME_SIZE, 3))
        self.texture, self.weight = pattern.astype(np.float32), texture
        self.rng = np.random.default_rng([seed, 2])

    def second(self, s: int, colour: str | None) -> list[str]:
        from apbv.synthetic.needles import COLOURS
        from apbv.video.footage import camera_frame

        out = []
        for i in (2 * s, 2 * s + 1):
            if colour is None:
                planes = camera_frame(i, fps=2.0, width=self.side, height=self.side,
                                      seed=self.seed, objects=0, background=self.background)
                scene = (1 - self.weight) * _rgb(planes, self.side) + self.weight * self.texture
            else:
                scene = np.broadcast_to(np.asarray(COLOURS[colour], np.float32),
                                        (self.side, self.side, 3))
            noisy = scene + self.rng.normal(0.0, self.noise, scene.shape)
            out.append(_png(np.clip(np.rint(noisy), 0, 255).astype(np.uint8)))
        return out


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


STAGES = ("append_wait_s", "append_s", "eval_wait_s", "eval_s")


def score(cams: list[dict], seen: list[list[tuple[float, str, dict | None]]], hit: Any,
          false: Any) -> dict[str, Any]:
    """Recall, latency percentiles, false alerts and the stages of the detecting events of
    one question: ``seen[i]``: camera i's (client time, answer, stages) in order; ``hit(cam,
    answer)``: the answer detects its flash; ``false(cam, t, answer)``: a false alert."""
    latencies, parts, detected, alerts = [], [], 0, 0
    for cam, got in zip(cams, seen, strict=True):
        first = next(((t, st) for t, a, st in got if hit(cam, a) and cam["sent"] is not None
                      and t >= cam["sent"]), None)
        if first is not None and first[0] - cam["sent"] <= DETECT_S:
            detected += 1
            latencies.append(first[0] - cam["sent"])
            if first[1] is not None:
                parts.append(first[1])
        alerts += sum(1 for t, a, _ in got if false(cam, t, a))
    hours = len(cams) * cams[0]["seconds"] / 3600

    def pct(q: float) -> float | None:
        return float(np.percentile(latencies, q)) if latencies else None
    stages = {name: float(np.mean([p[name] for p in parts if p.get(name) is not None]))
              for name in STAGES if any(p.get(name) is not None for p in parts)}
    return {"recall": detected / len(cams), "p50_s": pct(50), "p95_s": pct(95),
            "false_alerts_per_camera_hour": alerts / hours, "false_alerts": alerts,
            "stages_mean_s": stages or None}


def run_k(base: str, k: int, seconds: int, baseline: bool, seed: int,
          presence: str | None = None, *, threshold: float = 0.0, footage: str = "noise",
          noise: float = 2.0, texture: float = 0.5,
          presence_only: bool = False) -> list[dict[str, Any]]:
    """One run of ``k`` cameras (the watches, or the ``baseline``): its rows, the colour
    question's (unless ``presence_only``) and (``presence``, watches only) the presence
    question's; ``threshold``: the streams' ``static_threshold`` (0: off); ``footage``:
    ``noise`` or ``static`` (:class:`StaticCamera` of ``noise`` and ``texture``)."""
    from apbv.synthetic.needles import COLOURS

    colours = [c for c in COLOURS if c != "cyan"]
    rng = random.Random(seed)
    api = httpx.Client(base_url=base + "/v1", timeout=120)
    cams = []
    for _ in range(k):
        opened = api.post("/streams", json={
            "fps": 2, "width": 56, "height": 56, "min_pixels": 3136, "max_pixels": 3136,
            "window_s": 30, "keep_vision": baseline,
            **({"static_threshold": threshold} if threshold else {})}).json()
        if "id" not in opened:  # refused (the replica's budget): the camera goes unwatched
            print(f"stream refused: {opened}", flush=True)
        cams.append({"id": opened.get("id"), "flash_at": rng.randint(seconds // 3,
                                                                     2 * seconds // 3),
                     "colour": rng.choice(colours), "sent": None, "answers": [], "lag": 0.0,
                     "seconds": seconds, "watches": {}, "refused": 0})
    events = _Events(base)
    events.start()
    start = time.monotonic() + 1.0

    def camera(cam: dict, index: int) -> None:
        if cam["id"] is None:
            return
        frames = np.random.default_rng([seed, index])
        still = StaticCamera(seed * 1000 + index, noise, texture) if footage == "static" \
            else None
        offset = index / k  # cameras are not in step: each pushes at its own phase
        for s in range(seconds):
            flash = cam["colour"] if s == cam["flash_at"] else None
            pushed = _second(frames, flash) if still is None else still.second(s, flash)
            time.sleep(max(0.0, start + offset + s - time.monotonic()))
            sent = time.monotonic()
            api.post(f"/streams/{cam['id']}/frames", json={"frames": pushed})
            if flash:
                cam["sent"] = sent
            if 1 <= s < cam["flash_at"] and not baseline:  # the watches, once it holds frames
                asked = ([] if presence_only else [(QUESTION, list(COLOURS))]) + \
                    ([(presence, ["yes", "no"])] if presence else [])
                for question, choices in asked:
                    if question in cam["watches"].values():
                        continue
                    made = api.post(f"/streams/{cam['id']}/watches",
                                    json={"question": question, "choices": choices}).json()
                    if "id" in made:
                        cam["watches"][made["id"]] = question
                    else:  # refused (the replica's budget): asked again the next second
                        cam["refused"] += 1
                        if cam["refused"] == 1 or s == cam["flash_at"] - 1:
                            print(f"watch {question!r} on {cam['id']} at {s} s: {made}",
                                  flush=True)
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
    path = "baseline" if baseline else "watch"
    if baseline:
        seen = [[(t, a, None) for t, a in c["answers"] if a != "cyan"] for c in cams]
    else:
        seen = [[(t, e["answer"], e.get("stages")) for t, e in events.got
                 if c["watches"].get(e["watch"]) == QUESTION] for c in cams]
    common = {"k": k, "seconds": seconds, "threshold": threshold, "footage": footage,
              "opened": sum(c["id"] is not None for c in cams),
              "watched": sum(bool(c["watches"]) for c in cams),
              "watch_refusals": sum(c["refused"] for c in cams)}
    rows = [] if presence_only and not baseline else [{
        "path": path, "question": QUESTION, **common, **score(
            cams, seen, lambda c, a: a == c["colour"],
            lambda c, t, a: a != c["colour"] or (c["sent"] is not None and t < c["sent"]))}]
    if presence and not baseline:
        seen = [[(t, e["answer"], e.get("stages")) for t, e in events.got
                 if c["watches"].get(e["watch"]) == presence] for c in cams]
        rows.append({"path": "watch (presence)", "question": presence, **common, **score(
                         cams, seen, lambda c, a: a == "yes",
                         lambda c, t, a: a == "yes" and (c["sent"] is None or t < c["sent"]))})
    for row in rows:
        row["max_eval_lag_s"] = None if baseline else max(c["lag"] for c in cams)
    for cam in cams:
        if cam["id"] is not None:
            api.delete(f"/streams/{cam['id']}")
    return rows


def write_markdown(path: Path, report: dict[str, Any]) -> None:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [f"# Standing questions on K cameras ({report['machine']})", "",
             f"Trained tiny model, {report['world_size']} CPU ranks, {report['seconds']} s of "
             f"2 fps {report.get('footage', 'noise')} footage per camera, one flash each; "
             f"`{report.get('command', 'python benchmarks/bench_watch.py')}`.", "",
             "| K | path | static_threshold | streams opened (watched, watch refusals) | "
             "recall | p50 latency (s) | "
             "p95 latency (s) | false alerts / camera-h | max evaluation lag (s) | append "
             "queued / run, evaluation queued / run (mean s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        st = r.get("stages_mean_s")
        parts = "-" if not st else " / ".join(f(st.get(n)) for n in STAGES)
        watched = "" if "watched" not in r else \
            f" ({r['watched']}, {r['watch_refusals']})"
        lines.append(f"| {r['k']} | {r['path']} | {r.get('threshold', 0):g} | "
                     f"{r.get('opened', r['k'])}{watched} | {r['recall']:.2f} | "
                     f"{f(r['p50_s'])} | "
                     f"{f(r['p95_s'])} | {r['false_alerts_per_camera_hour']:.0f} | "
                     f"{f(r['max_eval_lag_s'])} | {parts} |")
    for threshold, best in (report.get("sustained_by_threshold") or {}).items():
        lines += ["", f"static_threshold {threshold}: largest K sustained (recall >= 0.9, "
                      f"p95 <= 2 s): {best}"]
    k = report["sustained_k"]
    at_k = {r["path"]: r for r in report["runs"] if r["k"] == k and not r.get("threshold")}
    beside = ""
    if k is not None and "watch" in at_k:
        base = at_k.get("baseline")
        beside = (f" (watches p95 {f(at_k['watch']['p95_s'])} s; the baseline's p95 at K = {k}: "
                  + ("not run)" if base is None else
                     f"{f(base['p95_s'])} s, recall {base['recall']:.2f})"))
    lines += ["", f"Largest K run that watches sustained (recall >= 0.9, p95 <= 2 s): {k}"
                  f"{beside}", "", f"Machine load: {report.get('load', '-')}", ""]
    path.write_text("\n".join(lines))


def plot(path: Path, report: dict[str, Any]) -> None:
    """p95 detection latency and recall against K, watches beside the baseline."""
    plt = pyplot()
    if plt is None:
        return
    fig, (lat, rec) = plt.subplots(1, 2, figsize=(9, 3.5))
    lines = sorted({(r["path"], r.get("threshold", 0.0)) for r in report["runs"]})
    for name, threshold in lines:
        runs = [r for r in report["runs"] if (r["path"], r.get("threshold", 0.0)) ==
                (name, threshold)]
        ks = [r["k"] for r in runs]
        label = name if not threshold else f"{name}, static_threshold {threshold:g}"
        lat.plot(ks, [r["p95_s"] if r["p95_s"] is not None else float("nan") for r in runs],
                 "o-", label=label)
        rec.plot(ks, [r["recall"] for r in runs], "o-", label=label)
    lat.axhline(2.0, color="grey", ls=":", label="2 s")
    lat.set(xlabel="cameras K", ylabel="p95 flash -> event (s)", xscale="log", xticks=[])
    rec.set(xlabel="cameras K", ylabel="recall", ylim=(0, 1.05), xscale="log")
    for ax in (lat, rec):
        ax.set_xticks(sorted({r["k"] for r in report["runs"]}))
        ax.get_xaxis().set_major_formatter(plt.ScalarFormatter())
        ax.minorticks_off()
    save_figure(fig, path, styled=(lat, rec))


def _uptime() -> str:
    """This machine's load averages (1, 5, 15 min) and CPU count, for the report."""
    import os

    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def _comma_list(text: str, kind: Callable[[str], Any], option: str, what: str) -> list[Any]:
    """``text`` split at commas, each part read by ``kind``; SystemExit naming ``option`` and
    ``what`` it takes when a part does not read."""
    try:
        return [kind(part) for part in text.split(",")]
    except ValueError:
        raise SystemExit(f"{option} takes comma-separated {what}, got {text!r}") from None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cameras", default="1,2,4,8,12,16",
                   help="the K to run, comma-separated")
    p.add_argument("--seconds", type=int, default=40, help="footage per camera per run")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paths", default="watch,baseline",
                   help="which to run per K, comma-separated: watch, baseline")
    p.add_argument("--presence-question", default=None,
                   help="also watch this yes / no question on each camera (e.g. \"Is there a "
                        "flash?\"), for a model trained on it")
    p.add_argument("--presence-only", action="store_true",
                   help="watch the --presence-question alone (no colour question)")
    p.add_argument("--footage", default="noise", choices=("noise", "static"),
                   help="noise seconds, or static cameras (see the module docstring)")
    p.add_argument("--noise", type=float, default=2.0,
                   help="static footage: sensor noise, grey levels (standard deviation)")
    p.add_argument("--texture", type=float, default=0.5,
                   help="static footage: the fixed texture's weight over the camera's scene")
    p.add_argument("--thresholds", default="0",
                   help="the streams' static_threshold values to run per K (0: pruning off); "
                        "each stops at the first K it does not sustain")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "watch_cpu"))
    args = p.parse_args()
    if args.presence_only and not args.presence_question:
        raise SystemExit("--presence-only needs --presence-question")
    thresholds = _comma_list(args.thresholds, float, "--thresholds", "numbers")
    if args.seconds < 12:
        raise SystemExit("--seconds must be >= 12 (the flash falls in the middle third)")
    ks = _comma_list(args.cameras, int, "--cameras", "integers")
    if not ks or min(ks) < 1:
        raise SystemExit(f"--cameras takes K >= 1, got {args.cameras!r}")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not paths or set(paths) - {"watch", "baseline"}:
        raise SystemExit(f"--paths takes watch and/or baseline, got {args.paths!r}")
    if args.presence_question is not None and not args.presence_question.strip():
        raise SystemExit("--presence-question must be a non-empty question")
    load = {"before": _uptime()}
    serve = argparse.Namespace(world_size=args.world_size, vision_cache_gb=0, max_queue=64,
                               serve_args=("--max-streams", str(max(8, *ks))))
    scored = "watch (presence)" if args.presence_only else "watch"

    def sustained(row: dict[str, Any]) -> bool:
        return row["path"] == scored and row["recall"] >= 0.9 and row["p95_s"] is not None \
            and row["p95_s"] <= 2.0

    broken: set[float] = set()  # thresholds past the K they sustain: not run further
    with tempfile.TemporaryDirectory() as media:
        proc, base, _ = start_server(NEEDLE_TINY, Path(media), _free_port(), serve)
        try:
            runs = []
            for k in ks:
                for path in paths:
                    for threshold in thresholds if path == "watch" else [0.0]:
                        if path == "watch" and threshold in broken:
                            continue
                        rows = run_k(base, k, args.seconds, path == "baseline", args.seed + k,
                                     args.presence_question, threshold=threshold,
                                     footage=args.footage, noise=args.noise,
                                     texture=args.texture, presence_only=args.presence_only)
                        runs += rows
                        for row in rows:
                            print(json.dumps(row), flush=True)
                        if path == "watch" and not any(sustained(r) for r in rows):
                            broken.add(threshold)
        finally:
            stop_server(proc)
    by_threshold = {f"{t:g}": max((r["k"] for r in runs if sustained(r)
                                   and r["threshold"] == t), default=None) for t in thresholds}
    report = {"machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
              "world_size": args.world_size, "seconds": args.seconds, "runs": runs,
              "footage": args.footage, "noise": args.noise, "texture": args.texture,
              "command": "python benchmarks/bench_watch.py " + shlex.join(sys.argv[1:]),
              "sustained_k": by_threshold.get("0"), "sustained_by_threshold": by_threshold,
              "load": f"load average before: {load['before']}; after: {_uptime()}"}
    Path(args.out + ".json").write_text(json.dumps(report, indent=2))
    write_markdown(Path(args.out + ".md"), report)
    plot(Path(args.out + ".png"), report)
    print(Path(args.out + ".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
