"""Per-stage wall-clock timing on every rank; the slowest rank decides each stage.

Each stage ends with a device synchronisation (CUDA work is asynchronous) and a barrier of the
ranks, so a stage's time includes its GPU work and the wait for the slowest rank lands in the
stage that caused it (not in the next collective's stage). The stages then add up to the wall
time: TTFT is the sum of the stages up to and including the first token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from apbv import comm

STAGES = ("preprocess", "vision", "transfer", "prefill", "first_token", "decode")
"""The engine's stages, in order (:mod:`apbv.engine.engine` says what each one holds)."""
TTFT_STAGES = STAGES[:5]
"""The stages up to and including the first token: their sum is the TTFT."""


class StageTimer:
    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None):
        self.device = device
        self.group = group
        self.seconds: dict[str, float] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        yield  # an error propagates untimed (and without a barrier the other ranks would wait on)
        self._sync()
        comm.barrier(self.group)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def max_over_ranks(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Each stage's time on the slowest rank (a collective: call it on every rank)."""
        return {name: comm.all_reduce_max(s, group) for name, s in self.seconds.items()}


def best_time(
    fn: Callable[[], Any],
    repeats: int,
    *,
    warmup: int = 1,
    slowest_rank: bool = True,
    group: dist.ProcessGroup | None = None,
) -> float:
    """Best wall time of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones.

    The ranks start each call together (a barrier). With ``slowest_rank`` each call also ends
    with a barrier and counts the slowest rank's time (a collective: call it on every rank);
    without it, each rank reports its own time.
    """
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        comm.barrier(group)
        start = time.perf_counter()
        fn()
        if slowest_rank:
            comm.barrier(group)
            best = min(best, comm.all_reduce_max(time.perf_counter() - start, group))
        else:
            best = min(best, time.perf_counter() - start)
    return best
