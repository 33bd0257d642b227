"""The order a replica's queue runs its waiting jobs in (a pure rule, no server):
:func:`next_job`.

1. A chat request with ``deadline_ms``: earliest deadline first (as admission predicted it).
2. An evaluation of a standing question (``Job.evaluates``: the arrival of the oldest chunk it
   is the first to see): oldest chunk first, before any other work, so the answer on a chunk
   comes right after its append and not behind the appends of other cameras that arrived
   meanwhile. Each stream has at most one evaluation waiting per watch (they are coalesced,
   :mod:`apbv.serve.watches.evaluator`), so they cannot starve the rest.
3. Everything else round robin over lanes (each live stream's operations are one lane, the chat
   requests together another): the oldest job of the lane served least recently (a lane never
   served first; ties to the older job), so a camera pushing in bursts, or many chat requests,
   cannot hold the others back. Within a lane jobs keep their arrival order (a stream's
   operations must).

Every job taken, whichever the rule, is its lane's turn (:func:`take_turn`).
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping, Sequence
from typing import Protocol

CHAT_LANE = ""
"""The lane of the chat requests (a live stream's lane is its id)."""
MAX_LANES = 256
"""Lanes whose turn is remembered; past that the least recently served are forgotten (a lane
forgotten counts as never served, which the least recently served are anyway)."""


class Queued(Protocol):
    """What the rule reads of a waiting job (:class:`apbv.serve.scheduler.admission.Job`)."""

    key: tuple[float, int]
    """(deadline, monotonic s; inf without one; arrival number)."""
    stream_id: str | None
    evaluates: float | None


def lane(job: Queued) -> str:
    return CHAT_LANE if job.stream_id is None else job.stream_id


def next_job(waiting: Sequence[Queued], turns: MutableMapping[str, int]) -> int:
    """The index in ``waiting`` (non-empty) of the job to run next; ``turns``: lane -> the
    number of its last turn (:func:`take_turn`; absent: never served)."""
    assert waiting, "nothing waits"
    best = min(range(len(waiting)), key=lambda i: waiting[i].key)
    if math.isfinite(waiting[best].key[0]):
        return best  # 1. earliest deadline
    evaluations = [i for i, job in enumerate(waiting) if job.evaluates is not None]
    if evaluations:  # 2. the oldest chunk's evaluation
        return min(evaluations, key=lambda i: (waiting[i].evaluates, waiting[i].key))
    heads: dict[str, int] = {}  # 3. round robin: each lane's oldest job
    for i, job in enumerate(waiting):
        held = heads.get(lane(job))
        if held is None or job.key < waiting[held].key:
            heads[lane(job)] = i
    return min(heads.values(), key=lambda i: (turns.get(lane(waiting[i]), -1), waiting[i].key))


def take_turn(job: Queued, turns: MutableMapping[str, int]) -> None:
    """Record that ``job``'s lane was served now (its turn is the newest); at most
    :data:`MAX_LANES` lanes are remembered."""
    turns[lane(job)] = max(turns.values(), default=-1) + 1
    while len(turns) > MAX_LANES:
        del turns[min(turns, key=turns.__getitem__)]


def run_order(waiting: Sequence[Queued], turns: MutableMapping[str, int]) -> list[int]:
    """The indices of ``waiting`` in the order :func:`next_job` would take them if nothing
    else came (``turns`` is left as it was)."""
    turns, left, order = dict(turns), list(range(len(waiting))), []
    while left:
        i = left.pop(next_job([waiting[j] for j in left], turns))
        take_turn(waiting[i], turns)
        order.append(i)
    return order
