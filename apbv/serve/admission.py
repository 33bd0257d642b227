"""Admission: a bounded queue, FIFO by default and earliest deadline first for requests with
``deadline_ms``; a request whose predicted TTFT (the cost model, plus the work queued ahead of
it) already misses its deadline is refused at once (503 with the prediction).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from apbv.serve.policy import ClientError

Predictor = Callable[[Any, dict[str, int]], float]
"""(ChatCall, what check_request measured) -> predicted TTFT in seconds."""


@dataclass(eq=False)
class Job:
    call: Any
    predicted_s: float
    key: tuple[float, int]
    enqueued: float = field(default_factory=time.monotonic)
    future: asyncio.Future = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    tokens: asyncio.Queue | None = None
    started: float | None = None


class Admission:
    """The waiting requests, ordered by (deadline, arrival); one runs at a time."""

    def __init__(self, max_queue: int, predictor: Predictor | None = None):
        self.max_queue = max_queue
        self.predictor = predictor
        self.heap: list[tuple[tuple[float, int], Job]] = []
        self.running: Job | None = None
        self.seq = itertools.count()
        self.ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self.heap)

    def admit(self, call: Any, measured: dict[str, int], *, stream: bool = False,
              predicted_s: float | None = None) -> Job:
        """Queue ``call`` (its TTFT predicted from ``measured``, unless ``predicted_s`` is
        given, as for a live-stream operation), or ClientError (429: full; 503: its deadline
        cannot be met)."""
        if len(self.heap) >= self.max_queue:
            raise ClientError(429, f"the queue is full: {len(self.heap)} requests waiting, the "
                                   f"limit is {self.max_queue} (--max-queue)")
        predicted = predicted_s if predicted_s is not None else \
            self.predictor(call, measured) if self.predictor is not None else 0.0
        now = time.monotonic()
        deadline = call.deadline_ms
        key = (now + deadline / 1000 if deadline is not None else math.inf, next(self.seq))
        if deadline is not None and self.predictor is not None:
            ahead = sum(j.predicted_s for k, j in self.heap if k < key)
            if self.running is not None:
                ahead += max(0.0, self.running.predicted_s
                             - (now - (self.running.started or now)))
            if ahead + predicted > deadline / 1000:
                raise ClientError(503, f"the deadline of {deadline:g} ms cannot be met: the "
                                       f"predicted TTFT is {predicted * 1000:.0f} ms plus "
                                       f"{ahead * 1000:.0f} ms of work queued ahead")
        job = Job(call, predicted, key, tokens=asyncio.Queue() if stream else None)
        heapq.heappush(self.heap, (key, job))
        self.ready.set()
        return job

    async def next(self) -> Job:
        while not self.heap:
            self.ready.clear()
            await self.ready.wait()
        _, job = heapq.heappop(self.heap)
        self.running = job
        return job

    def done(self, job: Job) -> None:
        if self.running is job:
            self.running = None

    def drop(self, job: Job) -> bool:
        """Remove a job that is still waiting; False if it already started."""
        for i, (_, j) in enumerate(self.heap):
            if j is job:
                self.heap.pop(i)
                heapq.heapify(self.heap)
                return True
        return False


def cost_predictor(model_path: str, world_size: int, hardware: str) -> Predictor:
    """TTFT predicted by :func:`apbv.cost.predict` on a hardware preset (or calibration)."""
    from apbv import cost

    dims = cost.checkpoint_dims(model_path)
    hw = cost.hardware(hardware)
    merge = dims.spatial_merge_size

    def predict(call: Any, measured: dict[str, int]) -> float:
        grid = (measured["height"] // (14 * merge), measured["width"] // (14 * merge))
        return cost.predict(call.request.mode.name, dims, context_len=measured["context_len"],
                            query_len=measured["query_len"], world_size=world_size,
                            frames=measured["frames"], grid=grid, hw=hw,
                            anchor_len=call.request.anchor_len,
                            passing_len=call.request.passing_len).ttft_s

    return predict
