"""Per-stage wall-clock timing on every rank; the slowest rank decides each stage.

Each stage ends with a device synchronisation (CUDA work is asynchronous), so a stage's time
includes its GPU work. TTFT is the sum of the stages up to and including the first token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from apbv import comm


class StageTimer:
    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def max_over_ranks(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Each stage's time on the slowest rank (a collective: call it on every rank)."""
        return {name: comm.all_reduce_max(s, group) for name, s in self.seconds.items()}
