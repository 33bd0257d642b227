"""NCCL collectives inside a captured CUDA graph, on one GPU (a 1-rank NCCL group).

The decode step's all-gathers are captured with it (apbv/engine/decode_graph.py) on NCCL
ranks; this is the smallest run that exercises what that needs, on the one GPU a short loan
gives: a 1-rank NCCL group launches real NCCL kernels, so

1. a few eager collectives are left in flight (the NCCL watchdog polls their events while the
   capture runs, which used to invalidate captures),
2. ``layers`` x (a matmul + the project's own all-gather, ``comm.start_all_gather(...).wait()``)
   is captured on a side stream with ``capture_error_mode="thread_local"``, into a graph
   memory pool,
3. the graph is replayed ``replays`` times on fresh inputs and each output compared with the
   same loop run eagerly (fp32: the same kernels, so within :data:`TOLERANCE`).

:func:`graph_case` runs it (CUDA, inside a process that has a 1-rank NCCL group);
:func:`cpu_case` runs its CPU-side logic on a 1-rank gloo group (the loop eagerly, the
all-gather a real collective on a one-rank group). benchmarks/multirank_check.py's ``nccl``
part and tests/gpu/test_nccl_graph.py call them.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from apbv import comm

TOLERANCE = 1e-5
"""Largest |graph - eager| relative to the largest |eager| value (fp32, the same kernels)."""


def layer_loop(x: torch.Tensor, weight: torch.Tensor, layers: int) -> torch.Tensor:
    """``layers`` x (tanh(x @ weight) (n, d), all-gathered over the default group through
    :func:`apbv.comm.start_all_gather` and averaged over the ranks): (n, d)."""
    for _ in range(layers):
        y = torch.tanh(x @ weight)
        pending = comm.start_all_gather(y)
        assert pending.work is not None or not comm.is_distributed(), "no collective ran"
        x = pending.wait().mean(0)
    return x


def _inputs(device: torch.device, n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g).to(device)
    weight = (torch.randn(d, d, generator=g) / d**0.5).to(device)
    return x, weight


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / max(1e-30, float(want.abs().max()))


def graph_case(device: torch.device, layers: int = 28, replays: int = 20,
               in_flight: int = 8) -> dict[str, Any]:
    """The case on CUDA (the process's default group a 1-rank NCCL group): the largest
    relative |graph - eager| over the replays, the capture's and one replay's milliseconds
    against the eager loop's, and whether every check held (``ok``)."""
    assert comm.is_distributed(), "make the 1-rank NCCL group first"
    x, weight = _inputs(device, 64, 256)
    stream = torch.cuda.current_stream(device)
    want = layer_loop(x, weight, layers)
    pending = [comm.start_all_gather(torch.full((1024,), float(i), device=device))
               for i in range(in_flight)]  # eager work in flight during the capture
    static_in = x.clone()
    side = torch.cuda.Stream(device)
    side.wait_stream(stream)
    with torch.cuda.stream(side):  # the warm-up, as the decode step's
        layer_loop(static_in, weight, layers)
    stream.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle(),
                          capture_error_mode="thread_local"):
        static_out = layer_loop(static_in, weight, layers)
    capture_ms = (time.perf_counter() - t0) * 1e3
    flight_ok = all(bool((p.wait() == i).all()) for i, p in enumerate(pending))
    worst, replay_s, eager_s = 0.0, [], []
    for i in range(replays):
        fresh = x * (1 + i / replays)
        static_in.copy_(fresh)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize(device)
        replay_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        want = layer_loop(fresh, weight, layers)
        torch.cuda.synchronize(device)
        eager_s.append(time.perf_counter() - t0)
        worst = max(worst, _relative(static_out, want))
    return {"ok": worst <= TOLERANCE and flight_ok, "max_rel_diff": worst,
            "tolerance": TOLERANCE, "in_flight_ok": flight_ok, "layers": layers,
            "replays": replays, "capture_ms": capture_ms,
            "replay_ms": min(replay_s) * 1e3, "eager_ms": min(eager_s) * 1e3}


def cpu_case(layers: int = 28) -> dict[str, Any]:
    """The CPU-side logic (the process's default group a 1-rank gloo group): the loop with a
    real one-rank all-gather per layer equals the same arithmetic without collectives."""
    assert comm.is_distributed(), "make the 1-rank gloo group first"
    x, weight = _inputs(torch.device("cpu"), 64, 256)
    got = layer_loop(x, weight, layers)
    want = x
    for _ in range(layers):
        want = torch.tanh(want @ weight)
    diff = _relative(got, want)
    return {"ok": diff <= TOLERANCE, "max_rel_diff": diff, "tolerance": TOLERANCE,
            "layers": layers}
