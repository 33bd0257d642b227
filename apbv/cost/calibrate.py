"""The CPU rates as loaded now: a short measurement in as many processes as the run will have
(:func:`calibrate_here`), and the hardware constants it implies (:func:`as_loaded`).

The ``cpu`` preset holds an idle machine's constants (``benchmarks/calibrate_cpu.py``). On a
machine shared with other work each process gets a share of a core, and every kind of work it
does (kernels, frame decoding, Python and op dispatch, the eval harness, the copies of a
collective) takes that much longer. So each process measures the share of a core it gets: CPU
seconds over wall seconds of a busy Python loop of about ``seconds`` (a window long enough to
average the scheduler's slices and the other jobs' bursts), all processes at once, as the
run's ranks will be (:func:`calibrate_here` forks them; a benchmark's own ranks call
:func:`probe_rank`). The preset's rates are then divided, and its seconds multiplied, by the
inverse of the mean share.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from typing import Any

from apbv.cost.hardware import Hardware

RATE_FIELDS = ("matmul_flops", "conv_flops", "attention_flops", "memory_bw", "link_bw")
"""Throughputs: divided by the slowdown."""
SECONDS_FIELDS = ("attention_pair_s", "link_latency_s", "decode_s_per_pixel",
                  "process_s_per_pixel", "preprocess_fixed_s", "tokenize_s_per_token",
                  "layer_overhead_s", "vision_layer_overhead_s", "call_overhead_s",
                  "coded_frame_s_per_pixel", "keyframe_s_per_pixel", "convert_s_per_pixel",
                  "graph_layer_s", "graph_capture_s", "sample_overhead_s")
"""Times: multiplied by the slowdown (the other float fields are ratios)."""


def probe(seconds: float = 2.0) -> dict[str, float]:
    """This process's ``host_share`` now: CPU seconds over wall seconds of a busy loop of
    about ``seconds``."""
    wall, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        sum(range(2000))
    return {"host_share": (time.process_time() - cpu) / (time.perf_counter() - wall)}


def probe_rank(info: Any, seconds: float = 2.0) -> dict[str, float]:
    """:func:`probe` on one of the spawned ranks (``info`` unused: every rank alike)."""
    return probe(seconds)


def as_loaded(hw: Hardware, probes: Sequence[dict[str, float]]) -> Hardware:
    """``hw`` (an idle machine's constants) as the ``probes`` (one per process, :func:`probe`)
    found the machine: its :data:`RATE_FIELDS` divided and its :data:`SECONDS_FIELDS`
    multiplied by the inverse of the probes' mean share of a core. The name says by how
    much."""
    if not probes:
        raise ValueError("as_loaded needs at least one probe")
    share = statistics.fmean(p["host_share"] for p in probes)
    if not 0 < share <= 1.5:  # process time can run a little ahead of the wall clock
        raise ValueError(f"a probe's share of a core must be in (0, 1], got {share}")
    slower = 1.0 / min(share, 1.0)
    changes: dict[str, Any] = {k: getattr(hw, k) / slower for k in RATE_FIELDS}
    changes.update({k: getattr(hw, k) * slower for k in SECONDS_FIELDS})
    changes["name"] = f"{hw.name} as loaded now ({slower:.2f}x its times)"
    return dataclasses.replace(hw, **changes)


def slowdown(loaded: Hardware, idle: Hardware) -> float:
    """How many times ``idle``'s times ``loaded`` (:func:`as_loaded`) predicts."""
    return idle.matmul_flops / loaded.matmul_flops


def _probe_into(queue: Any, seconds: float) -> None:
    queue.put(probe(seconds))


def calibrate_here(hw: Hardware, processes: int, seconds: float = 2.0) -> Hardware:
    """:func:`as_loaded` of ``processes`` probes run at once (the run's ranks), each in a
    process forked from this one (no start-up to wait for)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    children = [ctx.Process(target=_probe_into, args=(queue, seconds), daemon=True)
                for _ in range(processes)]
    for child in children:
        child.start()
    try:
        probes = [queue.get(timeout=seconds + 60) for _ in children]
    finally:
        for child in children:
            child.join(timeout=5)
    return as_loaded(hw, probes)
