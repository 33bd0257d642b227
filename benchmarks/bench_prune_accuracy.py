"""Accuracy of the trained tiny model with temporal pruning, per answer class, exact and spava.

    PYTHONPATH=. python benchmarks/bench_prune_accuracy.py            # 2 CPU ranks
    PYTHONPATH=. python benchmarks/bench_prune_accuracy.py --thresholds 2,4,8,16,32 \\
        --rates 0.5,0.75 --per-class 10 --out benchmarks/results/prune_accuracy_cpu

Two held-out needle sets (seeds no training set uses), answered by ``apbv/assets/needle-tiny``
(or ``--model``) on ``--ranks`` gloo ranks, every video in every variant:

- **static camera** (:mod:`apbv.synthetic.camera`): a fixed scene with sensor noise, lighting
  drift and block-compression grain; a coloured flash or a coloured object crossing the frame
  at a random time; "What colour is the flash?" / "... the moving object?". A class is an
  event and a colour: ``--per-class`` videos each, ``--patches`` temporal patches. Variants:
  ``video.static_threshold`` 0 (off) and each of ``--thresholds`` (levels 0-255).
- **noise needles** (:mod:`apbv.synthetic.needles`, retrieval: noise frames, one flash; nothing
  is static): ``--per-class`` videos per colour, asked at ``video.pruning_rate`` 0 and each of
  ``--rates``. A rate the engine refuses (per-token pruning not implemented) is printed as
  refused and skipped; the rest runs.

A video is right when the greedy answer is exactly the colour. Printed and written to
``--out``.md/.json: accuracy per class, mode and setting; the video tokens kept (of the
unpruned prompt's) and how often the event's first patch was kept; and the threshold the
target picks, the fewest tokens where in both modes every class of the event is >= 0.9 and the
event's accuracy (all its videos) is within 0.05 of unpruned. (A class of 10 videos moves in
steps of 0.1, so its own drop is printed beside it, not held to 0.05.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CAMERA_SEED = 7_000_003
NOISE_SEED = 7_000_019
"""Seeds of the two sets: the trainer draws from 0 and 1000003, the fixtures from 5000011."""
MODES = ("exact", "spava")


def camera_set(per_class: int, patches: int) -> list[Any]:
    from apbv.synthetic.camera import CAMERA_KINDS, camera_sample
    from apbv.synthetic.needles import COLOURS

    return [camera_sample(kind, patches=patches, seed=CAMERA_SEED, index=c * per_class + i,
                          colour=colour)
            for kind in CAMERA_KINDS for c, colour in enumerate(COLOURS) for i in range(per_class)]


def noise_set(per_class: int, patches: int) -> list[Any]:
    from apbv.synthetic.needles import COLOURS, answer_of, make_sample

    wanted = {c: per_class for c in COLOURS}
    out, index = [], 0
    while any(wanted.values()):
        colour = answer_of("retrieval", patches=patches, seed=NOISE_SEED, index=index)
        if wanted[colour]:
            out.append(make_sample("retrieval", patches=patches, seed=NOISE_SEED, index=index))
            wanted[colour] -= 1
        index += 1
    return out


def _job(info: Any, model: str, args: argparse.Namespace) -> dict[str, Any]:
    from apbv.config import load_config
    from apbv.engine.engine import Engine
    from apbv.engine.request import Request

    cfg = load_config("tiny_cpu", [f"model.path={model!r}", "video.min_pixels=3136",
                                   "video.max_pixels=3136", "cache.vision_gb=0"])
    engine = Engine(cfg, info)
    out: dict[str, Any] = {"camera": {}, "noise": {}, "refused": {}}

    def ask(sample: Any, mode: str, **prune: float) -> dict[str, Any]:
        result = engine.generate(Request(video=sample.video(), question=sample.question,
                                         mode=mode, max_new_tokens=8, **prune))
        return {"answer": result.answer.strip(), "context_len": result.context_len}

    cameras = camera_set(args.per_class, args.patches)
    for mode in MODES:
        for threshold in [0.0, *args.thresholds]:
            rows = [ask(s, mode, static_threshold=threshold) for s in cameras]
            out["camera"][f"{mode}/{threshold:g}"] = rows
            if info.rank == 0:
                right = sum(r["answer"] == s.answer for r, s in zip(rows, cameras))
                print(f"camera {mode} threshold {threshold:g}: {right}/{len(rows)}",
                      file=sys.stderr, flush=True)
    noises = noise_set(args.per_class, args.patches)
    for mode in MODES:
        for rate in [0.0, *args.rates]:
            try:
                rows = [ask(s, mode, pruning_rate=rate) for s in noises]
            except ValueError as exc:  # refused alike on every rank, before any work
                out["refused"][f"{rate:g}"] = str(exc)
                if info.rank == 0:
                    print(f"noise {mode} pruning_rate {rate:g}: refused: {exc}",
                          file=sys.stderr, flush=True)
                continue
            out["noise"][f"{mode}/{rate:g}"] = rows
            if info.rank == 0:
                right = sum(r["answer"] == s.answer for r, s in zip(rows, noises))
                print(f"noise {mode} pruning_rate {rate:g}: {right}/{len(rows)}",
                      file=sys.stderr, flush=True)
    return out


def _accuracy(rows: list[dict[str, Any]], samples: list[Any], keep: Any) -> float | None:
    pairs = [(r, s) for r, s in zip(rows, samples) if keep(s)]
    return sum(r["answer"] == s.answer for r, s in pairs) / len(pairs) if pairs else None


def _classes(samples: list[Any]) -> list[tuple[str, Any]]:
    """(name, test) of each class: event kind and colour, then each kind, then all."""
    from apbv.synthetic.needles import COLOURS

    kinds = sorted({s.kind for s in samples})
    out = [(f"{k.replace('camera_', '')} {c}", lambda s, k=k, c=c: (s.kind, s.answer) == (k, c))
           for k in kinds for c in COLOURS]
    for kind in kinds:
        out.append((f"all {kind.replace('camera_', '')} videos", lambda s, k=kind: s.kind == k))
    return out + [("all", lambda s: True)]


def _table(results: dict[str, list[dict[str, Any]]], samples: list[Any], label: str
           ) -> list[str]:
    variants = list(results)
    lines = [f"| class | n | {' | '.join(v.replace('/', ' ' + label + '=') for v in variants)} |",
             "|---|---:|" + "---:|" * len(variants)]
    for name, keep in _classes(samples):
        n = sum(1 for s in samples if keep(s))
        cells = [f"{_accuracy(results[v], samples, keep):.2f}" for v in variants]
        lines.append(f"| {name} | {n} | {' | '.join(cells)} |")
    return lines


def report(res: dict[str, Any], args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    from apbv.synthetic.camera import CAMERA_KINDS
    from apbv.video.prune import keep_mask, signatures

    cameras = camera_set(args.per_class, args.patches)
    video_tokens = 4 * args.patches
    base = [r["context_len"] for r in res["camera"]["exact/0"]]
    lines = [f"Static camera: {len(cameras)} videos ({args.per_class} per class: an event, "
             f"flash or moving object, and a colour), {args.patches} temporal patches "
             f"({2 * args.patches} frames at 2 fps, {video_tokens} video tokens unpruned); "
             f"{args.ranks} CPU ranks; "
             f"accuracy per class at video.static_threshold (levels 0-255; 0 = off).", ""]
    lines += _table(res["camera"], cameras, "threshold")
    summary: dict[str, Any] = {"kept": {}, "event_kept": {}, "passes": {}}
    lines += ["", "| threshold | video tokens kept (of unpruned) | event's first patch kept | "
                  "target met per event (each class >= 0.9, the event within 0.05 of off, "
                  "both modes) | largest drop of a class from off |",
              "|---:|---:|---:|---|---|"]
    named = _classes(cameras)
    classes = [(name, keep) for name, keep in named if name.split()[0] in CAMERA_KINDS]
    events = {name.split()[1]: keep for name, keep in named
              if name.startswith("all ") and name.split()[1] in CAMERA_KINDS}

    def acc(mode: str, keep: Any, at: float) -> float:
        value = _accuracy(res["camera"][f"{mode}/{at:g}"], cameras, keep)
        assert value is not None, "every class and event has videos"
        return value

    for threshold in [0.0, *args.thresholds]:
        rows = res["camera"][f"exact/{threshold:g}"]
        kept = sum(video_tokens - (b - r["context_len"]) for r, b in zip(rows, base)) / (
            video_tokens * len(rows))
        firsts = sum(threshold == 0 or keep_mask(signatures(s.frames, 2, (2, 2)), threshold)[
            s.needles[0][0]] for s in cameras) / len(cameras)
        ok = {kind: threshold > 0 and all(
            acc(m, events[kind], threshold) >= acc(m, events[kind], 0.0) - 0.05
            and all(acc(m, keep, threshold) >= 0.9 for name, keep in classes
                    if name.startswith(kind + " "))
            for m in MODES) for kind in CAMERA_KINDS}
        drop = max(acc(m, keep, 0.0) - acc(m, keep, threshold)
                   for m in MODES for _, keep in classes)
        summary["kept"][f"{threshold:g}"] = kept
        summary["event_kept"][f"{threshold:g}"] = firsts
        summary["passes"][f"{threshold:g}"] = ok
        met = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in ok.items())
        lines.append(f"| {threshold:g} | {kept:.3f} | {firsts:.2f} | "
                     f"{'-' if threshold == 0 else met} | {drop:+.2f} |")
    for kind in CAMERA_KINDS:
        passing = [t for t in args.thresholds if summary["passes"][f"{t:g}"][kind]]
        best = min(passing, key=lambda t: (summary["kept"][f"{t:g}"], t)) if passing else None
        summary.setdefault("recommended", {})[kind] = best
        lines.append(f"\n{kind} videos: the threshold meeting the target with the fewest "
                     f"tokens: {'none' if best is None else f'video.static_threshold={best:g}'}")
    lines.append("")
    noises = noise_set(args.per_class, args.patches)
    lines += [f"Noise needles (nothing static): {len(noises)} retrieval videos "
              f"({args.per_class} per colour), {args.patches} temporal patches; accuracy at "
              f"video.pruning_rate (0 = off).", ""]
    lines += _table(res["noise"], noises, "rate")
    for rate, why in res["refused"].items():
        lines.append(f"\npruning_rate {rate}: refused by the engine ({why}); rerun this "
                     f"benchmark once per-token pruning is in.")
    return "\n".join(lines) + "\n", summary


def main(argv: list[str] | None = None) -> None:
    from apbv.distributed import spawn_local

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: apbv/assets/needle-tiny)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--per-class", type=int, default=10)
    p.add_argument("--patches", type=int, default=128)
    p.add_argument("--thresholds", default="2,4,8,16,32")
    p.add_argument("--rates", default="0.5,0.75")
    p.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = p.parse_args(argv)
    args.thresholds = [float(t) for t in args.thresholds.split(",") if t]
    args.rates = [float(r) for r in args.rates.split(",") if r]
    model = args.model
    if model is None:  # recorded as the shipped model's name, not this machine's path
        from apbv.assets import needle_tiny

        model, args.model = str(needle_tiny()), "apbv/assets/needle-tiny"
    res = spawn_local(_job, args.ranks, (model, args), timeout_s=7200,
                      collective_timeout_s=600)[0]
    text, summary = report(res, args)
    print(text)
    if args.out:
        Path(f"{args.out}.md").write_text(text, encoding="utf-8")
        Path(f"{args.out}.json").write_text(json.dumps(
            {"args": {k: v for k, v in vars(args).items() if k != "out"}, "summary": summary,
             "results": res}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
