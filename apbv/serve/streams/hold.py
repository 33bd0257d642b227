"""The server's judgement of a pruned stream's pushes (``static_threshold`` > 0): a push that
keeps no temporal patch costs the ranks nothing.

Such a push adds no tokens on the ranks (:mod:`apbv.engine.stream_prune`), yet sending it there
costs one job (the frames to every rank, their digest compared across the ranks, their
signatures): about what a tiny model's whole append costs. So the server judges each push of a
pruned stream first, with the ranks' code on the same frames: a
:class:`~apbv.engine.stream_prune.ChunkPruner` of the threshold, units and cells the ranks
opened the stream with (:class:`~apbv.engine.stream_plan.StreamInfo`'s ``static_threshold``
and ``pruning_grid``), against its own copy of the stream's last kept signature, and the
stream's odd frame (:func:`~apbv.engine.stream_prune.whole_units`), both updated only when the
ranks took the push. A push that keeps no patch is *held*: no job; it is answered as the
ranks would answer it (no chunk, no tokens, its whole patches counted, none kept).

Held pushes go to the ranks ahead of the next push sent (:class:`~apbv.serve.ranks.ops.Append`'s
``held``: each appended alone and in order, checked there to keep nothing): the next push that
keeps a patch, or the one that would take the held frames past ``limit`` (the most frames of
one push: what a stream's backlog may keep in memory). The ranks then hold what they would have
held had every push gone to them as it came: the same chunks, M-RoPE times, ``<t seconds>``
and ``FrameN:``, frame counts and evictions (a chunk evicts by its own times; held pushes make
none). A stream's GET adds its backlog to the ranks' counts (:meth:`PushHold.counted`).

Nothing is held before the stream's first kept patch. An append the queue refused (it never
ran) leaves the backlog and the judgement as they were. One that failed once queued stops the
judging for the stream, as the ranks may have taken part of it: every later push is sent at
once and judged there; the backlog stays until an append succeeds (the ranks skip a held push
they already have, so a resend is exact). Closing a stream drops its backlog (nothing later
needs it). Without a threshold there is no holder and nothing changes.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from apbv.engine.stream_plan import Appended, StreamInfo
from apbv.engine.stream_prune import ChunkKeep, ChunkPruner, Pending, whole_units
from apbv.serve.ranks.ops import Append

if TYPE_CHECKING:
    from apbv.serve.scheduler.admission import Job

Push = tuple[torch.Tensor, tuple[float, ...]]
"""A push's frames (uint8 (F, 3, H, W)) and their timestamps (seconds)."""


@dataclass(frozen=True)
class Verdict:
    """The server's judgement of one push."""

    keep: ChunkKeep
    """Its whole temporal patches' keep mask (the odd frame before it completing the first)."""
    pending: Pending
    """The odd frame left after it."""
    held: bool
    """Whether it is held: it keeps no patch, one was kept before, the backlog has room."""

    @property
    def answer(self) -> Appended:
        """What the ranks answer a push that keeps no patch."""
        return Appended(chunk=None, owner=None, tokens=0, evicted=0,
                        patches=len(self.keep.keep))


class PushHold:
    """One pruned stream's judge and backlog: its threshold (levels, > 0), frames per temporal
    patch ``unit``, merged-patch ``cells`` (gh, gw) and the most frames held ``limit``."""

    def __init__(self, threshold: float, unit: int, cells: tuple[int, int], limit: int):
        self.pruner = ChunkPruner(threshold, unit, cells)
        self.limit = limit
        self.pending: Pending = None
        self.backlog: list[Push] = []
        self.frames = 0
        """Frames in the backlog."""
        self.patches = 0
        """Whole temporal patches the backlog's pushes completed (none kept)."""
        self.judging = True
        self.pushes_held = 0
        """Pushes held since the stream opened."""

    @classmethod
    def of(cls, info: StreamInfo, limit: int) -> PushHold | None:
        """The holder of a stream the ranks opened as ``info`` says (None: no pruning)."""
        if info.static_threshold <= 0:
            return None
        unit, gh, gw = info.pruning_grid
        return cls(info.static_threshold, unit, (gh, gw), limit)

    def judge(self, frames: torch.Tensor, stamps: list[float]) -> Verdict:
        """How the ranks would take ``frames`` at ``stamps`` now (nothing changes here)."""
        unit = self.pruner.unit
        whole, times, pending = whole_units(self.pending, frames, list(stamps), unit)
        keep = self.pruner.judge(whole) if times else ChunkKeep((), self.pruner.last)
        held = self.pruner.last is not None and not any(keep.keep) and \
            self.frames + len(stamps) <= self.limit
        return Verdict(keep, pending, held)

    async def append(self, admit: Callable[[Append], Job], stream_id: str, frames: torch.Tensor,
                     stamps: list[float]) -> tuple[Appended, float | None]:
        """Push ``frames`` at ``stamps`` to stream ``stream_id``, held or through ``admit``
        (queues the op on the stream's replica; raises when the queue refuses it): (what the
        ranks did, or would do, the seconds its job waited in the queue; None: held)."""
        verdict = await asyncio.to_thread(self.judge, frames, stamps) if self.judging else None
        if verdict is not None and verdict.held:
            self.backlog.append((frames, tuple(stamps)))
            self.frames += len(stamps)
            self.patches += len(verdict.keep.keep)
            self.pending = verdict.pending
            self.pushes_held += 1
            return verdict.answer, None
        job = admit(Append(stream_id, frames, tuple(stamps), tuple(self.backlog)))
        try:
            result, wait = cast(tuple[Appended, float], await job.future)
        except BaseException:
            self.judging = False  # the ranks may have taken part of it: they judge from here
            raise
        self.backlog, self.frames, self.patches = [], 0, 0
        if verdict is not None:
            self.pruner.commit(verdict.keep)
            self.pending = verdict.pending
        return result, wait

    def counted(self, info: StreamInfo) -> StreamInfo:
        """The ranks' ``info`` with the backlog counted as they will count it: its frames
        appended and its whole patches pruned."""
        return dataclasses.replace(info, frames_appended=info.frames_appended + self.frames,
                                   patches_pruned=info.patches_pruned + self.patches)


async def append(hold: PushHold | None, admit: Callable[[Append], Job], stream_id: str,
                 frames: torch.Tensor, stamps: list[float]) -> tuple[Appended, float | None]:
    """:meth:`PushHold.append`, or without a holder (no pruning) the push sent as it is."""
    if hold is not None:
        return await hold.append(admit, stream_id, frames, stamps)
    result, wait = await admit(Append(stream_id, frames, tuple(stamps))).future
    return cast(Appended, result), cast(float, wait)
