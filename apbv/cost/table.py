"""The ``plan`` command's table of predictions (:func:`prediction_table`): one row per mode."""

from __future__ import annotations

from apbv.cost.predict import Prediction
from apbv.timing import TTFT_STAGES


def prediction_table(predictions: list[Prediction]) -> str:
    """One row per mode: stage seconds, TTFT with and without preprocessing, speedups over
    ``full`` and ``zigzag_ring`` (when predicted) and the largest per-rank KV cache; for
    answers of more than one token also the seconds per decoded token and to the last
    token, eagerly and, where the hardware has CUDA graphs, with ``decode.graphs`` (the
    replayed step, the capture paid once per KV bucket, and the last token of the request
    that captures)."""
    by_mode = {p.mode: p for p in predictions}
    answer = max(p.answer_tokens for p in predictions) > 1
    graphs = answer and all(p.graphs is not None for p in predictions)
    head = (f"{'mode':<13} {'TTFT s':>9} " + " ".join(f"{s:>11}" for s in TTFT_STAGES)
            + f" {'no-prep s':>10} {'x full':>7} {'x zigzag':>8} {'KV GiB/rank':>11}"
            + (f" {'decode ms/tok':>13} {'last token s':>12}" if answer else "")
            + (f" {'graph ms/tok':>12} {'capture s':>9} {'last graphs s':>13}"
               if graphs else ""))
    lines = [head]
    for p in predictions:
        speedups = []
        for base in ("full", "zigzag_ring"):
            other = by_mode.get(base)
            speedups.append(f"{other.ttft_s / p.ttft_s:.2f}" if other else "-")
        kv = max(r.kv_bytes for r in p.ranks) / 1024**3
        line = (f"{p.mode:<13} {p.ttft_s:>9.3f} "
                + " ".join(f"{p.seconds[s]:>11.3f}" for s in TTFT_STAGES)
                + f" {p.device_ttft_s:>10.3f} {speedups[0]:>7} {speedups[1]:>8} {kv:>11.3f}")
        if answer:
            line += f" {1e3 * p.decode_token_s:>13.2f} {p.last_token_s:>12.3f}"
        if graphs and p.graphs is not None and p.last_token_graphs_s is not None:
            line += (f" {1e3 * p.graphs.token_s:>12.2f} {p.graphs.capture_s:>9.3f}"
                     f" {p.last_token_graphs_s:>13.3f}")
        lines.append(line)
    spava = by_mode.get("spava")
    others = [m for m in ("full", "zigzag_ring", "apb") if m in by_mode]
    if spava and others:
        ratios = ", ".join(f"{by_mode[m].device_ttft_s / spava.device_ttft_s:.2f}x {m}"
                           for m in others)
        lines.append(f"spava's speedup without preprocessing (what the reference times): {ratios}")
    if graphs and any(p.graphs is not None and not p.graphs.captured for p in predictions):
        lines.append("decode.graphs: the answer is too short to capture (eager decode)")
    elif graphs:
        first = spava or predictions[0]
        assert first.graphs is not None
        lines.append(f"decode.graphs: the first request of a KV bucket captures (capture s, in "
                     f"last graphs s); a later one replays every step: last token "
                     f"{first.ttft_s + first.graphs.reused_s:.3f} s ({first.mode})")
    return "\n".join(lines)
