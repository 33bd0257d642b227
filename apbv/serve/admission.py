"""Admission: a bounded queue, FIFO by default and earliest deadline first for requests with
``deadline_ms``; a request whose predicted TTFT (the cost model, plus the work queued ahead of
it) already misses its deadline is refused at once (503 with the prediction).

The cost model's TTFT is for its hardware preset; the machine the replica runs on may be
faster or slower. Each finished request corrects it: the replica keeps the geometric running
mean of measured / modelled TTFT (:data:`LEARN_RATE`) and predicts the model's TTFT times that
scale, so deadline admission follows the machine after a few requests.
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

LEARN_RATE = 0.25
"""Weight of each finished request's log(measured / modelled TTFT) in the replica's scale
(an exponential mean in log space, from 1.0: one slow first request moves it by its ratio
r to r ** 0.25; ten requests at a steady ratio r bring it to r ** 0.94)."""
SCALE_BOUNDS = (0.01, 100.0)
"""The learned scale stays inside these bounds (a stalled or instant request is not a rate)."""

_ARRIVALS = itertools.count()
"""Arrival numbers, shared by every replica's queue: a job handed to another replica keeps its
place in arrival order there (:meth:`Admission.take`)."""


@dataclass(eq=False)
class Job:
    call: Any
    predicted_s: float
    key: tuple[float, int]
    modelled_s: float = 0.0
    """The cost model's TTFT before the learned scale (0: not predicted by the model)."""
    enqueued: float = field(default_factory=time.monotonic)
    future: asyncio.Future = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    tokens: asyncio.Queue | None = None
    started: float | None = None
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the client went away while the job ran: its decode stops at the next step."""
    name: str = "job"
    """What the server's log calls it (a chat request's completion id, a stream operation)."""


class Admission:
    """The waiting requests, ordered by (deadline, arrival); one runs at a time."""

    def __init__(self, max_queue: int, predictor: Predictor | None = None):
        self.max_queue = max_queue
        self.predictor = predictor
        self.heap: list[tuple[tuple[float, int], Job]] = []
        self.running: Job | None = None
        self.ready = asyncio.Event()
        self.scale = 1.0
        """Measured / modelled TTFT learned from finished requests (see :meth:`learn`)."""
        self.learned = 0

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
        modelled = 0.0
        if predicted_s is not None:
            predicted = predicted_s
        elif self.predictor is not None:
            modelled = self.predictor(call, measured)
            predicted = modelled * self.scale
        else:
            predicted = 0.0
        now = time.monotonic()
        deadline = call.deadline_ms
        key = (now + deadline / 1000 if deadline is not None else math.inf, next(_ARRIVALS))
        if deadline is not None and self.predictor is not None:
            ahead = sum(j.predicted_s for k, j in self.heap if k < key)
            if self.running is not None:
                ahead += max(0.0, self.running.predicted_s
                             - (now - (self.running.started or now)))
            if ahead + predicted > deadline / 1000:
                learned = (f" (the cost model's {modelled * 1000:.0f} ms x {self.scale:.2f}, "
                           f"the measured/modelled ratio of {self.learned} finished requests)"
                           if self.learned and modelled else "")
                raise ClientError(503, f"the deadline of {deadline:g} ms cannot be met: the "
                                       f"predicted TTFT is {predicted * 1000:.0f} ms{learned} "
                                       f"plus {ahead * 1000:.0f} ms of work queued ahead")
        job = Job(call, predicted, key, modelled, tokens=asyncio.Queue() if stream else None)
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

    def learn(self, job: Job, ttft_s: float) -> None:
        """Correct the scale with a finished job's measured TTFT (jobs the model did not
        predict, and non-positive times, teach nothing)."""
        if job.modelled_s <= 0 or not ttft_s > 0:
            return
        step = LEARN_RATE * (math.log(ttft_s / job.modelled_s) - math.log(self.scale))
        self.scale = min(max(self.scale * math.exp(step), SCALE_BOUNDS[0]), SCALE_BOUNDS[1])
        self.learned += 1

    def done(self, job: Job) -> None:
        if self.running is job:
            self.running = None

    def waiting(self) -> list[Job]:
        """The waiting jobs, in the order they would run."""
        return [job for _, job in sorted(self.heap, key=lambda item: item[0])]

    def take(self, job: Job) -> None:
        """Queue ``job``, waiting in another replica's queue until now, in its place here
        (deadline, then arrival; its prediction as it was)."""
        heapq.heappush(self.heap, (job.key, job))
        self.ready.set()

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
