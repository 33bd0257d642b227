"""The CPU rates as loaded now: a short measurement in as many processes as the run will have
(:func:`calibrate_here`), and the hardware constants it implies (:func:`as_loaded`).

The ``cpu`` preset holds an idle machine's constants (``benchmarks/calibrate_cpu.py``). On a
shared machine each process gets a share of a core, and compute and host work (dispatch,
decoding, the harness) slow alike; so each process measures, for about ``seconds`` each, the
matmul rate of the preset's matmul (:data:`MATMUL`, the throughput over the whole window, so
time slicing counts) and the memory bandwidth of a large add, all processes at once; with more
than one, a collective's latency through :mod:`apbv.comm`. The preset's compute rates and host
times are then scaled by its matmul rate over the measured one, the memory bandwidth and the
link latency taken as measured.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from typing import Any

from apbv.cost.hardware import Hardware

MATMUL = (4096, 256, 768)
"""Rows, in, out of the probe's F.linear: ``benchmarks/calibrate_cpu.py``'s, the preset's."""
ADD_ELEMENTS = 1 << 22
"""float32 elements of each operand of the probe's add (three 16 MiB tensors)."""
HOST_FIELDS = ("attention_pair_s", "decode_s_per_pixel", "process_s_per_pixel",
               "preprocess_fixed_s", "tokenize_s_per_token", "layer_overhead_s",
               "vision_layer_overhead_s", "call_overhead_s", "coded_frame_s_per_pixel",
               "keyframe_s_per_pixel", "convert_s_per_pixel", "sample_overhead_s")
"""Seconds of work that a loaded machine stretches as it stretches a matmul."""
RATE_FIELDS = ("matmul_flops", "conv_flops", "attention_flops", "link_bw")
"""Rates (compute, and the link's copies through the host) scaled by the measured matmul rate
over the preset's."""


def _window(fn: Any, seconds: float) -> float:
    """Seconds per call of ``fn`` averaged over a window of about ``seconds`` (one warm-up
    call first)."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / calls


def probe(seconds: float = 0.4) -> dict[str, float]:
    """This process's rates now: ``matmul_flops`` and ``memory_bw`` (bytes read and written
    by an add), each averaged over about ``seconds``."""
    import torch
    import torch.nn.functional as F

    rows, d_in, d_out = MATMUL
    x, w = torch.randn(rows, d_in), torch.randn(d_out, d_in)
    a, b, c = (torch.randn(ADD_ELEMENTS) for _ in range(3))
    matmul_s = _window(lambda: F.linear(x, w), seconds)
    add_s = _window(lambda: torch.add(a, b, out=c), seconds)
    return {"matmul_flops": 2.0 * rows * d_in * d_out / matmul_s,
            "memory_bw": 3 * 4 * ADD_ELEMENTS / add_s}


def probe_rank(info: Any, seconds: float = 0.4) -> dict[str, float]:
    """:func:`probe` on one of the spawned ranks, then a collective's latency (median of
    20 one-element all-gathers) when there are several."""
    from apbv import comm

    out = probe(seconds)
    if info.world_size > 1:
        import torch

        x, times = torch.zeros(1), []
        comm.all_gather(x)
        for _ in range(20):
            comm.barrier()
            start = time.perf_counter()
            comm.all_gather(x)
            times.append(time.perf_counter() - start)
        out["link_latency_s"] = statistics.median(times)
    return out


def as_loaded(hw: Hardware, probes: Sequence[dict[str, float]]) -> Hardware:
    """``hw`` as the ``probes`` (one per process, :func:`probe`) found the machine: its compute
    rates and host seconds (:data:`RATE_FIELDS`, :data:`HOST_FIELDS`) scaled by its matmul rate
    over the probes' mean, its memory bandwidth (and link latency, when measured) the probes'
    mean. The name says by how much."""
    if not probes:
        raise ValueError("as_loaded needs at least one probe")
    measured = {k: statistics.fmean(p[k] for p in probes) for k in probes[0]}
    slower = hw.matmul_flops / measured["matmul_flops"]
    changes: dict[str, Any] = {k: getattr(hw, k) / slower for k in RATE_FIELDS}
    changes.update({k: getattr(hw, k) * slower for k in HOST_FIELDS})
    changes["memory_bw"] = measured["memory_bw"]
    if "link_latency_s" in measured:
        changes["link_latency_s"] = measured["link_latency_s"]
    changes["name"] = f"{hw.name} as loaded now ({slower:.2f}x its times)"
    return dataclasses.replace(hw, **changes)


def slowdown(loaded: Hardware, idle: Hardware) -> float:
    """How many times ``idle``'s times ``loaded`` (:func:`as_loaded`) predicts."""
    return idle.matmul_flops / loaded.matmul_flops


def calibrate_here(hw: Hardware, processes: int, seconds: float = 0.4) -> Hardware:
    """:func:`as_loaded` of ``processes`` probes run at once (the run's ranks, each one
    thread), as spawned local gloo ranks."""
    from apbv.distributed import spawn_local

    probes = spawn_local(probe_rank, processes, (seconds,), timeout_s=300)
    return as_loaded(hw, probes)
