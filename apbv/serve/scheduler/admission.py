"""Admission: a bounded queue, earliest deadline first for requests with ``deadline_ms``, then
the evaluations of standing questions, oldest chunk first, then round robin over lanes (each
live stream's operations, the chat requests together; each lane in arrival order):
:mod:`apbv.serve.scheduler.fair_order`. A request whose predicted TTFT (the cost model, plus
the work queued ahead of it) already misses its deadline is refused at once (503 with the
prediction), and one whose deadline can no longer be met when it reaches the ranks is refused
then (504, :meth:`expired`) without running.

The work ahead of a request is every job that runs before it: each one's TTFT and its decode
(``max_tokens`` x the replica's learned seconds per token), and the running job's remaining
time (its TTFT still to come, if any, and the decode of its tokens not yet generated; a job
past its prediction still counts its undecoded tokens, never 0).

The cost model's TTFT is for its hardware preset; the machine the replica runs on may be
faster or slower. Each finished request corrects it: the replica keeps the geometric running
mean of measured / modelled TTFT (:data:`LEARN_RATE`) and predicts the model's TTFT times that
scale, so deadline admission follows the machine after a few requests. The seconds per
generated token are learned the same way, from each answer's (total time - TTFT) / (tokens -
1), starting from a prior (:func:`apbv.cost.decode_token_s` on the hardware preset, or
:data:`DECODE_PRIOR_S`).

With a :class:`apbv.serve.scheduler.memory_budget.MemoryBudget`, a chat request is also sized in
host memory before it is queued, and refused (503 or 429, with the figures) when it would
take the server's work past the budget.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from apbv.openai import request_id
from apbv.openai.policy import ClientError
from apbv.serve.ranks.ops import Generate, Op
from apbv.serve.scheduler.fair_order import next_job, run_order, take_turn

if TYPE_CHECKING:
    from apbv.openai.chat import ChatCall
    from apbv.openai.download import Held

Predictor = Callable[["ChatCall", dict[str, int]], float]
"""(ChatCall, what check_request measured) -> predicted TTFT in seconds."""

LEARN_RATE = 0.25
"""Weight of each finished request's log(measured / modelled TTFT) in the replica's scale
(an exponential mean in log space, from 1.0: one slow first request moves it by its ratio
r to r ** 0.25; ten requests at a steady ratio r bring it to r ** 0.94)."""
SCALE_BOUNDS = (0.01, 100.0)
"""The learned scale stays inside these bounds (a stalled or instant request is not a rate)."""
DECODE_PRIOR_S = 0.1
"""Seconds per generated token before any answer was measured, without a cost model: on the
slow side of what a decode step takes (a 7B model's step on one GPU is ~0.02-0.05 s; the
tiny CPU model's ~0.01 s), so early deadlines are refused rather than missed."""
DECODE_BOUNDS = (1e-5, 10.0)
"""The learned seconds per token stay inside these bounds."""

_ARRIVALS = itertools.count()
"""Arrival numbers, shared by every replica's queue: a job handed to another replica keeps its
place in arrival order there (:meth:`Admission.take`)."""


@dataclass(eq=False)
class Job:
    op: Op[object]
    """What every rank of the replica runs: a chat request's Generate, or a live stream's
    operation (:mod:`apbv.serve.ranks.ops`)."""
    call: ChatCall | None
    """The chat request it answers (deadline, download, video); None for a live stream's
    operation."""
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
    max_tokens: int = 0
    """Tokens it may generate (0: no decode, as a stream's append)."""
    generated: int = 0
    """Tokens generated so far (counted by the replica while it runs)."""
    token_times: list[float] = field(default_factory=list)
    """time.monotonic() of each token's arrival (the replica's ``on_token``)."""
    stream_id: str | None = None
    """The live stream whose operation it is: it runs only on the ranks that hold the stream
    (replica ``generation``), never handed to another replica; None: a chat request."""
    generation: int = 0
    """The replica's generation (rebuilds) whose ranks hold ``stream_id``."""
    evaluates: float | None = None
    """An evaluation of a standing question: the arrival (monotonic s) of the oldest chunk
    it is the first to see (:mod:`apbv.serve.scheduler.fair_order` runs it before other work)."""
    host_bytes: int = 0
    """Host memory its ranks hold for it (:class:`apbv.serve.scheduler.memory_budget.MemoryBudget`;
    0: not sized, as a live stream's operation, whose memory is its stream's reservation)."""
    replica: Runner = field(init=False)
    """The replica whose queue holds it (set by the server once admitted)."""
    request_id: str | None = field(default_factory=request_id.current)
    """The id of the HTTP request that made it (:mod:`apbv.openai.request_id`), for the log."""

    @property
    def downloaded(self) -> Held | None:
        """The stored download its video is (deleted once the job ends), or None."""
        return None if self.call is None else self.call.downloaded


class Runner(Protocol):
    """The replica a job was handed to (:class:`apbv.serve.scheduler.replicas.Replica`), as
    far as the job's handlers use it."""

    index: int
    admission: Admission


class HostBudget(Protocol):
    """The host memory budget every replica's admission shares
    (:class:`apbv.serve.scheduler.memory_budget.MemoryBudget`)."""

    def register(self, admission: Admission) -> None: ...

    def admit(self, call: ChatCall, measured: dict[str, int], admission: Admission) -> int: ...


class Admission:
    """The waiting requests, taken in the order of
    :func:`apbv.serve.scheduler.fair_order.next_job`; one runs at a time."""

    def __init__(self, max_queue: int, predictor: Predictor | None = None,
                 decode_s: float = DECODE_PRIOR_S, memory: HostBudget | None = None):
        self.max_queue = max_queue
        self.memory = memory
        """The host memory budget shared by every replica's admission (None: not counted)."""
        if memory is not None:
            memory.register(self)
        self.predictor = predictor
        self.heap: list[tuple[tuple[float, int], Job]] = []
        self.running: Job | None = None
        self.ready = asyncio.Event()
        self.scale = 1.0
        """Measured / modelled TTFT learned from finished requests (see :meth:`learn`)."""
        self.learned = 0
        self.decode_s = decode_s
        """Seconds per generated token: the prior, then learned (see :meth:`learn_decode`)."""
        self.decoded = 0
        self.turns: dict[str, int] = {}
        """Lane -> its last turn (:func:`apbv.serve.scheduler.fair_order.take_turn`)."""

    def __len__(self) -> int:
        return len(self.heap)

    def expected_s(self, job: Job) -> float:
        """The job's predicted time on the ranks: its TTFT and the decode of ``max_tokens``."""
        return job.predicted_s + job.max_tokens * self.decode_s

    def remaining_s(self, job: Job, now: float) -> float:
        """The running job's predicted time left: its TTFT still to come (none once it is
        past its prediction or has a token) and the decode of the tokens not yet generated."""
        ttft_left = 0.0 if job.generated else max(0.0, job.predicted_s
                                                  - (now - (job.started or now)))
        return ttft_left + max(0, job.max_tokens - job.generated) * self.decode_s

    def admit(self, call: ChatCall | None, measured: dict[str, int], *,
              op: Op[object] | None = None, sse: bool = False,
              predicted_s: float | None = None, max_tokens: int = 0,
              stream_id: str | None = None, generation: int = 0,
              evaluates: float | None = None) -> Job:
        """Queue ``call`` (its TTFT predicted from ``measured``, unless ``predicted_s`` is
        given, as for a live-stream operation; ``max_tokens`` it may generate; ``sse``: its
        tokens are handed to its ``tokens`` queue as they come) as a job that runs ``op``
        (default: Generate of the call's request; a live stream's operation has no ``call``
        and names its ``stream_id`` and the replica ``generation`` holding it; ``evaluates``:
        a standing question's evaluation, see :attr:`Job.evaluates`), or
        ClientError (429: full; 503: its deadline cannot be met; 400: a deadline that is not a
        finite number >= 0; with a memory budget, 503 or 429: its host memory does not fit,
        see :meth:`apbv.serve.scheduler.memory_budget.MemoryBudget.admit`)."""
        if op is None:
            assert call is not None, "a job runs a chat call's request or an op"
            op = Generate(call.request)
        deadline = None if call is None else call.deadline_ms
        if deadline is not None and not (math.isfinite(deadline) and deadline >= 0):
            raise ClientError(400, f"deadline_ms must be a finite number >= 0, got {deadline!r}")
        if len(self.heap) >= self.max_queue:
            raise ClientError(429, f"the queue is full: {len(self.heap)} requests waiting, the "
                                   f"limit is {self.max_queue} (--max-queue)")
        modelled = 0.0
        if predicted_s is not None:
            predicted = predicted_s
        elif self.predictor is not None and call is not None:
            modelled = self.predictor(call, measured)
            predicted = modelled * self.scale
        else:
            predicted = 0.0
        now = time.monotonic()
        key = (now + deadline / 1000 if deadline is not None else math.inf, next(_ARRIVALS))
        if deadline is not None and self.predictor is not None:
            before = [j for k, j in self.heap if k < key]
            ahead = sum(self.expected_s(j) for j in before)
            tokens = sum(j.max_tokens for j in before)
            if self.running is not None:
                ahead += self.remaining_s(self.running, now)
                tokens += max(0, self.running.max_tokens - self.running.generated)
            if ahead + predicted > deadline / 1000:
                learned = (f" (the cost model's {modelled * 1000:.0f} ms x {self.scale:.2f}, "
                           f"the measured/modelled ratio of {self.learned} finished requests)"
                           if self.learned and modelled else "")
                decode = (f", {tokens} tokens of it decoding at {self.decode_s * 1000:.1f} ms "
                          f"per token" if tokens else "")
                raise ClientError(503, f"the deadline of {deadline:g} ms cannot be met: the "
                                       f"predicted TTFT is {predicted * 1000:.0f} ms{learned} "
                                       f"plus {ahead * 1000:.0f} ms of work queued ahead"
                                       f"{decode}")
        host_bytes = 0
        if self.memory is not None and call is not None and stream_id is None:
            host_bytes = self.memory.admit(call, measured, self)
        job = Job(op, call, predicted, key, modelled,
                  tokens=asyncio.Queue() if sse else None, max_tokens=max_tokens,
                  stream_id=stream_id, generation=generation, evaluates=evaluates,
                  host_bytes=host_bytes)
        heapq.heappush(self.heap, (key, job))
        self.ready.set()
        return job

    async def next(self) -> Job:
        while not self.heap:
            self.ready.clear()
            await self.ready.wait()
        _, job = self.heap.pop(next_job([j for _, j in self.heap], self.turns))
        heapq.heapify(self.heap)
        take_turn(job, self.turns)
        self.running = job
        return job

    def expired(self, job: Job, now: float) -> ClientError | None:
        """The 504 for a job taken from the queue whose deadline has passed, or would pass
        before its predicted first token; None when it may run."""
        if job.key[0] == math.inf or now + job.predicted_s <= job.key[0]:
            return None
        assert job.call is not None, "only a chat request has a deadline"
        deadline, waited = job.call.deadline_ms, (now - job.enqueued) * 1000
        why = ("passed while it waited" if now > job.key[0] else
               f"would pass before its predicted TTFT of {job.predicted_s * 1000:.0f} ms")
        return ClientError(504, f"the deadline of {deadline:g} ms {why}: it waited "
                                f"{waited:.0f} ms in the queue and did not run")

    def learn(self, job: Job, ttft_s: float) -> None:
        """Correct the scale with a finished job's measured TTFT (jobs the model did not
        predict, and non-positive times, teach nothing)."""
        if job.modelled_s <= 0 or not ttft_s > 0:
            return
        self.scale = _toward(self.scale, ttft_s / job.modelled_s, SCALE_BOUNDS)
        self.learned += 1

    def learn_decode(self, decode_s: float, tokens: int) -> None:
        """Correct the seconds per token with an answer's ``decode_s`` (its time after the
        first token) for its ``tokens`` tokens after the first (none, or a non-positive time,
        teach nothing)."""
        if tokens < 1 or not decode_s > 0:
            return
        self.decode_s = _toward(self.decode_s, decode_s / tokens, DECODE_BOUNDS)
        self.decoded += 1

    def done(self, job: Job) -> None:
        if self.running is job:
            self.running = None

    def waiting(self) -> list[Job]:
        """The waiting jobs, in the order they would run if nothing else came."""
        jobs = [job for _, job in self.heap]
        return [jobs[i] for i in run_order(jobs, self.turns)]

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


def _toward(value: float, measured: float, bounds: tuple[float, float]) -> float:
    """``value`` moved :data:`LEARN_RATE` of the way to ``measured`` in log space, bounded."""
    step = LEARN_RATE * (math.log(measured) - math.log(value))
    return min(max(value * math.exp(step), bounds[0]), bounds[1])


def walked_frames(mode: str, world_size: int,
                  measured: dict[str, int]) -> tuple[list[int], list[int]] | None:
    """Per rank of ``mode`` on ``world_size`` ranks, the coded frames its decoder walks and
    their keyframe intervals (what :func:`apbv.cost.predict` takes as ``walked_frames`` and
    ``walked_intervals``), from the file's keyframe layout as
    :func:`apbv.video.gop.decode_work` measured it: the slowest rank's walk for every rank of
    a mode that splits the frames, the whole walk where one process or every rank decodes
    every frame; None when the layout is not known (the sampled frames alone are priced)."""
    from apbv.modes import get_mode

    spec = get_mode(mode)
    ranks = 1 if spec.single_process else world_size
    one = "" if spec.vit_split and not spec.single_process else "_one"
    if "walked" + one not in measured:
        return None
    return [measured["walked" + one]] * ranks, [measured["intervals" + one]] * ranks


def cost_predictor(model_path: str, world_size: int, hardware: str) -> Predictor:
    """TTFT predicted by :func:`apbv.cost.predict` on a hardware preset (or calibration),
    with the decode work of the file's keyframe layout (:func:`walked_frames`) and its
    decoded frame size where :func:`apbv.openai.chat.check_request` measured them."""
    from apbv import cost

    dims = cost.checkpoint_dims(model_path)
    hw = cost.hardware(hardware)
    merge = dims.spatial_merge_size

    def predict(call: ChatCall, measured: dict[str, int]) -> float:
        grid = (measured["height"] // (14 * merge), measured["width"] // (14 * merge))
        mode = call.request.mode.name
        walked = walked_frames(mode, world_size, measured)
        return cost.predict(mode, dims, context_len=measured["context_len"],
                            query_len=measured["query_len"], world_size=world_size,
                            frames=measured["frames"], grid=grid, hw=hw,
                            anchor_len=call.request.anchor_len,
                            passing_len=call.request.passing_len,
                            source_pixels=measured.get("source_pixels"),
                            walked_frames=walked[0] if walked else None,
                            walked_intervals=walked[1] if walked else None).ttft_s

    return predict


def cost_decode_prior(model_path: str, world_size: int, hardware: str,
                      context_len: int) -> float:
    """Seconds per generated token predicted by :func:`apbv.cost.decode_token_s` after a
    prompt of ``context_len`` tokens (the largest admitted: the slow side), the prior of
    :attr:`Admission.decode_s`."""
    from apbv import cost

    return cost.decode_token_s(cost.checkpoint_dims(model_path), context_len=context_len,
                               world_size=world_size, hw=cost.hardware(hardware))
