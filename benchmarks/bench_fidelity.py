"""Answer quality of every mode on held-out needle videos, against exact attention, in one run.

    python benchmarks/bench_fidelity.py                          # 2k and 8k tokens, 2 ranks
    python benchmarks/bench_fidelity.py --tokens 2048,8192,32768 --samples 12
    python benchmarks/bench_fidelity.py --write-vnbench DIR      # the same sets as VNBench files
    python benchmarks/bench_fidelity.py --per-class 10 --tokens 8192 --variants exact,spava

The model is the trained tiny checkpoint shipped in ``apbv/assets/needle-tiny`` (or
``--model``). For each task kind (retrieval, ordering, counting; :mod:`apbv.synthetic.needles`) and
each prompt length, ``--samples`` held-out videos are drawn (seed disjoint from training) with the
first needle at the depths ``--depths`` in turn. One set of ``--world-size`` gloo ranks loads
the engine once and answers every video in every variant: the modes (exact, spava, star, apb,
zigzag_ring) and spava with smaller passing budgets (a quarter of the default, and none). A
variant is right when its greedy answer equals the needle's; it agrees when it equals exact
mode's answer. Output: JSON lines, a markdown table (accuracy and agreement per kind, length
and variant) and a plot (accuracy against prompt length per variant, and against the passing
budget at the longest length).

``--per-class N`` measures per answer class instead (:mod:`fidelity_classes`): ``N`` held-out
videos per colour (retrieval, most recent flash) and per yes / no (presence), each asked
free-form and with its kind's closed vocabulary (``choices``).

Frames are generated in memory and passed to the engine already decoded
(:class:`apbv.video.DecodedVideo`): 56x56 frames at 2 fps, 4 prompt tokens per second.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import fidelity_classes
import torch
from common import pyplot, save_figure

from apbv.config import RuntimeConfig, load_config
from apbv.distributed import DistInfo, spawn_local
from apbv.plan import default_passing_len
from apbv.synthetic.needles import KINDS, make_sample, patches_for_tokens

VNBENCH_KINDS = ("retrieval", "ordering", "counting")
"""The kinds measured by default (VNBench's); ``--kinds`` adds presence and recent."""
SEED = 1_000_003 + 7
"""Held-out seed: the trainer uses seed + 0 (training) and seed + 1000003 (its own check)."""
MAX_NEW_TOKENS = 8
VARIANTS: dict[str, tuple[str, float | None]] = {
    "exact": ("exact", None),
    "spava": ("spava", None),
    "spava P/4": ("spava", 0.25),
    "spava P=0": ("spava", 0.0),
    "star": ("star", None),
    "apb": ("apb", None),
    "zigzag_ring": ("zigzag_ring", None),
}
"""label -> (mode, passing budget as a fraction of the default N/128; None: the mode's own)."""


def _variants(text: str) -> list[str]:
    """The variants named in ``text``, exact first (the others' logit error is measured
    against it)."""
    names = text.split(",")
    return sorted(names, key=lambda v: v != "exact")


def _jobs(tokens: list[int], samples: int, depths: list[float],
          kinds: tuple[str, ...] = VNBENCH_KINDS) -> list[dict[str, Any]]:
    return [{"kind": kind, "tokens": t, "index": i, "depth": depths[i % len(depths)]}
            for t in tokens for kind in kinds for i in range(samples)]


def _sample(job: dict[str, Any]):
    return make_sample(job["kind"], patches=patches_for_tokens(job["tokens"]), seed=SEED,
                       index=job["index"], depth=job["depth"])


def _passing(sample, fraction: float | None) -> int | None:
    """The passing budget of a variant's ``fraction`` of the default (None: the mode's)."""
    approx_context = sample.patches * 4 + 40
    return None if fraction is None else round(fraction * default_passing_len(approx_context))


def _rank_job(info: DistInfo, cfg: RuntimeConfig, jobs: list[dict],
              variants: list[str], per_class: bool = False) -> list[dict]:
    from apbv.engine.engine import Engine

    engine = Engine(cfg, info)
    if per_class:
        return fidelity_classes.rank_job(engine, info, jobs, variants, VARIANTS, _sample,
                                         _passing, MAX_NEW_TOKENS)
    rows = []
    for n, job in enumerate(jobs):
        sample = _sample(job)
        video = sample.video()
        reference = None  # exact mode's answer and first-token logits (exact runs first)
        for label in variants:
            mode, fraction = VARIANTS[label]
            passing = _passing(sample, fraction)
            result = fidelity_classes.free_answer(engine, sample, video, mode, passing,
                                                  MAX_NEW_TOKENS)
            answer = result.answer.strip()
            logits = result.first_logits.float()
            if label == "exact":
                reference = answer, logits
            rows.append({**job, "variant": label, "mode": mode, "answer": answer,
                         "expected": sample.answer, "correct": answer == sample.answer,
                         "needles": [list(x) for x in sample.needles],
                         "prompt_tokens": result.context_len + result.query_len,
                         "passing_len": result.passing_len, "anchor_len": result.anchor_len,
                         "ttft_s": result.ttft_s,
                         "agrees_with_exact": None if reference is None
                         else answer == reference[0],
                         "logit_err": None if reference is None
                         else float((logits - reference[1]).abs().max())})
        if info.rank == 0:
            mine = rows[-len(variants):]
            marks = " ".join(f"{r['variant']}={r['answer']!r}" for r in mine)
            print(f"[bench] {n + 1}/{len(jobs)} {job['kind']} {job['tokens']} depth "
                  f"{job['depth']}: expected {sample.answer!r}; {marks}", file=sys.stderr,
                  flush=True)
    return rows


def summarise(rows: list[dict]) -> dict[tuple, dict[str, float]]:
    """(kind, tokens, variant) -> accuracy, agreement, count, mean prompt tokens."""
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        cells[(r["kind"], r["tokens"], r["variant"])].append(r)
        cells[("all", r["tokens"], r["variant"])].append(r)
    out = {}
    for key, group in cells.items():
        agree = [r["agrees_with_exact"] for r in group if r["agrees_with_exact"] is not None]
        errs = [r["logit_err"] for r in group if r.get("logit_err") is not None]
        out[key] = {"accuracy": sum(r["correct"] for r in group) / len(group),
                    "agreement": sum(agree) / len(agree) if agree else float("nan"),
                    "n": len(group),
                    "logit_err": sum(errs) / len(errs) if errs else float("nan"),
                    "prompt_tokens": sum(r["prompt_tokens"] for r in group) / len(group),
                    "passing_len": group[0]["passing_len"]}
    return out


def markdown(rows: list[dict], variants: list[str]) -> str:
    stats = summarise(rows)
    tokens = sorted({r["tokens"] for r in rows})
    lines = ["Accuracy (agreement with exact) per task kind and prompt length; "
             f"{len(rows) // max(1, len(variants))} videos, each answered by every variant.",
             "",
             "| kind | prompt tokens | n | " + " | ".join(variants) + " |",
             "|---|---:|---:|" + "---|" * len(variants)]
    for kind in (*KINDS, "all"):
        for t in tokens:
            first = stats.get((kind, t, variants[0]))
            if first is None:
                continue
            cells = []
            for v in variants:
                s = stats[(kind, t, v)]
                cells.append(f"{s['accuracy']:.2f} ({s['agreement']:.2f})")
            lines.append(f"| {kind} | {first['prompt_tokens']:.0f} | {first['n']} | "
                         + " | ".join(cells) + " |")
    lines += ["", "How far each variant's first-token logits are from exact mode's: max abs "
              "difference, mean over the videos (fp32; exact against itself is 0).", "",
              "| prompt tokens | " + " | ".join(variants) + " |",
              "|---:|" + "---:|" * len(variants)]
    for t in tokens:
        lines.append(f"| {stats[('all', t, variants[0])]['prompt_tokens']:.0f} | "
                     + " | ".join(f"{stats[('all', t, v)]['logit_err']:.3g}" for v in variants)
                     + " |")
    passing = {v: sorted({r["passing_len"] for r in rows if r["variant"] == v})
               for v in variants}
    lines += ["", "Passing budget P per block (tokens, per length): "
              + "; ".join(f"{v}: {', '.join(map(str, p))}" for v, p in passing.items())]
    return "\n".join(lines)


def plot(rows: list[dict], variants: list[str], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False

    stats = summarise(rows)
    tokens = sorted({r["tokens"] for r in rows})
    kinds = [k for k in KINDS if any(r["kind"] == k for r in rows)]
    fig, axes = plt.subplots(1, len(kinds) + 1, figsize=(4 * (len(kinds) + 1), 3.8))
    for ax, kind in zip(axes, kinds):
        for v in variants:
            ys = [stats[(kind, t, v)]["accuracy"] for t in tokens if (kind, t, v) in stats]
            xs = [stats[(kind, t, v)]["prompt_tokens"] for t in tokens if (kind, t, v) in stats]
            ax.plot(xs, ys, marker="o", label=v)
        ax.set(xscale="log", xlabel="prompt tokens", ylabel="accuracy", title=kind,
               ylim=(-0.05, 1.05))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    longest = tokens[-1]
    budget = [("spava P=0", 0.0), ("spava P/4", 0.25), ("spava", 1.0), ("exact", 4.0)]
    for kind in kinds:
        pts = [(x, stats[(kind, longest, v)]["accuracy"]) for v, x in budget
               if (kind, longest, v) in stats]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=kind)
    ax.set_xticks([0.0, 0.25, 1.0, 4.0], ["0", "P/4", "P", "all\n(exact)"])
    ax.set(xlabel="passing budget (P = N/128)", ylabel="accuracy",
           title=f"spava vs passing, {longest} tokens", ylim=(-0.05, 1.05))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path, dpi=110)  # grids and legends set above


def run(args: argparse.Namespace) -> list[dict]:
    from apbv.assets import needle_tiny

    model = args.model or str(needle_tiny())
    cfg = load_config(args.config, [f"model.path={model!r}",
                                    f"parallel.timeout_s={args.timeout}"])
    if args.per_class:
        jobs = fidelity_classes.class_jobs(args.tokens, args.per_class, args.depths, SEED,
                                           args.kinds)
    else:
        jobs = _jobs(args.tokens, args.samples, args.depths, args.kinds)
    print(f"[bench] {len(jobs)} videos x {len(args.variants)} variants on {args.world_size} "
          "ranks", file=sys.stderr, flush=True)
    return spawn_local(_rank_job, args.world_size,
                       (cfg, jobs, args.variants, bool(args.per_class)),
                       timeout_s=7200, collective_timeout_s=args.timeout)[0]


def write_vnbench(out: str, tokens: list[int], samples: int, depths: list[float]) -> Path:
    """The same held-out sets in VNBench's format (annotation + mp4 files), for
    ``python -m apbv eval --bench vnbench --data OUT`` (add ``--set video.fps=2.0``)."""
    import av
    import numpy as np

    from apbv.synthetic.needles import FPS, answer_choices

    root = Path(out)
    (root / "VNBench").mkdir(parents=True, exist_ok=True)
    entries = []
    category = {"retrieval": "ret_insert1", "ordering": "ord_insert1", "counting": "cnt_insert1"}
    for job in _jobs(tokens, samples, depths):  # VNBench's kinds
        sample = _sample(job)
        name = f"needle_{job['kind']}_{job['tokens']}_{job['index']}.mp4"
        with av.open(str(root / "VNBench" / name), "w") as container:
            stream = container.add_stream("mpeg4", rate=int(FPS))
            stream.width = stream.height = sample.frames.shape[-1]
            stream.pix_fmt = "yuv420p"
            stream.options = {"qscale": "1"}
            for frame in sample.frames.permute(0, 2, 3, 1).numpy():
                packet = stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame),
                                                                  format="rgb24"))
                container.mux(packet)
            container.mux(stream.encode())
        options = list(answer_choices(job["kind"]))[:4]
        if sample.answer not in options:
            options[job["index"] % 4] = sample.answer
        for attempt in range(4):  # VNBench's 4 tries: the options rotated
            rotated = options[attempt:] + options[:attempt]
            entries.append({"video": f"./VNBench/{name}", "question": sample.question,
                            "options": rotated, "gt": sample.answer,
                            "gt_option": "ABCD"[rotated.index(sample.answer)],
                            "type": category[job["kind"]], "try": attempt,
                            "needle_time": [t / FPS * 2 for t, _ in sample.needles],
                            "length": sample.frames.shape[0] / FPS})
    path = root / "VNBench-main-4try.json"
    path.write_text(json.dumps(entries, indent=1) + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the shipped trained tiny model)")
    parser.add_argument("--config", default="tiny_cpu", help="config preset")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--tokens", default="2048,8192", help="prompt lengths, comma-separated")
    parser.add_argument("--samples", type=int, default=9, help="videos per kind and length")
    parser.add_argument("--depths", default="0.1,0.5,0.9",
                        help="depth of the first needle (fraction of the video), in turn")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--kinds", default=None,
                        help=f"task kinds, comma-separated, of {', '.join(KINDS)} (default: "
                             f"{', '.join(VNBENCH_KINDS)}; with --per-class: "
                             f"{', '.join(fidelity_classes.KINDS)})")
    parser.add_argument("--per-class", type=int, default=0, metavar="N",
                        help="N held-out videos per answer class, each asked free-form and "
                             "with choices (0: the per-kind benchmark)")
    parser.add_argument("--timeout", type=float, default=600.0, help="collective timeout (s)")
    parser.add_argument("--write-vnbench", metavar="DIR",
                        help="write the sets in VNBench's format to DIR and exit")
    parser.add_argument("--out", default="benchmarks/results/fidelity_cpu",
                        help="output stem: writes STEM.jsonl, STEM.md and STEM.png")
    args = parser.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variant(s) {sorted(unknown)}; allowed: {', '.join(VARIANTS)}")
    args.variants = variants = _variants(args.variants)
    allowed = fidelity_classes.KINDS if args.per_class else KINDS
    default = fidelity_classes.KINDS if args.per_class else VNBENCH_KINDS
    args.kinds = tuple(args.kinds.split(",")) if args.kinds else default
    if set(args.kinds) - set(allowed):
        parser.error(f"unknown kind(s) {sorted(set(args.kinds) - set(allowed))}; allowed: "
                     f"{', '.join(allowed)}")
    if args.per_class < 0:
        parser.error(f"--per-class must be >= 0, got {args.per_class}")
    args.tokens = [int(x) for x in args.tokens.split(",")]
    args.depths = [float(x) for x in args.depths.split(",")]
    if args.write_vnbench:
        print(write_vnbench(args.write_vnbench, args.tokens, args.samples, args.depths))
        return
    torch.set_num_threads(1)
    rows = run(args)
    stem = Path(args.out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "machine": platform.machine(),
            "ranks": args.world_size, "model": args.model or "apbv/assets/needle-tiny"}
    with open(stem.with_suffix(".jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps({**meta, **row}) + "\n")
    command = "python benchmarks/bench_fidelity.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    table = (fidelity_classes.markdown(rows, variants) if args.per_class
             else markdown(rows, variants))
    stem.with_suffix(".md").write_text(f"`{command.strip()}` ({args.world_size} CPU gloo "
                                       f"ranks)\n\n{table}\n")
    print(table)
    plotted = not args.per_class and plot(rows, variants, stem.with_suffix(".png"))
    print(json.dumps({"benchmark": "bench_fidelity", **meta, "rows": len(rows),
                      "jsonl": str(stem.with_suffix(".jsonl")),
                      "plot": str(stem.with_suffix(".png")) if plotted else None}))


if __name__ == "__main__":
    main()
