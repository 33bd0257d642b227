"""Temporal pruning of a live stream's appended chunks (``static_threshold`` > 0): the rule and
the signatures of :mod:`apbv.video.prune`, applied chunk by chunk.

Every rank receives the same frames at each append (:meth:`apbv.engine.stream.Stream.append`
checks it), so every rank computes the chunk's signatures and the same keep mask with no
collective: each temporal patch is judged against the stream's last kept patch, which may lie
in an earlier chunk (its signature is kept across appends, on every rank: each builds the
chunk's prompt). The first patch of the stream is always kept; a chunk may keep none (it adds
no tokens; its patches' time still passes, so the next kept patch takes the positions and
timestamps of its own capture time). That is the one-shot rule over the whole stream's patches
in order, so exact attention over a pruned stream equals a one-shot request with the same
threshold on the same frames (while nothing is evicted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from apbv.video.prune import keep_mask, signatures

Pending = tuple[torch.Tensor, float] | None
"""A stream's odd last frame (3, H, W) and its timestamp, waiting for the next append to
complete its temporal patch (None: none)."""


def whole_units(pending: Pending, frames: torch.Tensor, stamps: list[float],
                unit: int) -> tuple[torch.Tensor, list[float], Pending]:
    """(the whole temporal patches of ``unit`` frames that ``pending`` and an append's
    ``frames`` (uint8 (F, 3, H, W) at ``stamps``) complete, their stamps, the odd frame left
    to wait for the next append): how a stream groups its frames, whatever its pushes."""
    if pending is not None:
        frames = torch.cat([pending[0].unsqueeze(0), frames])
        stamps = [pending[1]] + stamps
        pending = None
    if len(stamps) % unit:
        pending = (frames[-1].clone(), stamps[-1])
        frames, stamps = frames[:-1], stamps[:-1]
    return frames, stamps, pending


@dataclass(frozen=True)
class ChunkKeep:
    """What pruning keeps of one chunk (identical on every rank)."""

    keep: tuple[bool, ...]
    """Per temporal patch of the chunk, whether it is kept."""
    last: torch.Tensor | None
    """(3, gh, gw) the signature of the stream's last kept patch once the chunk is held."""

    @property
    def units(self) -> tuple[int, ...]:
        """The kept patches' indices in the chunk."""
        return tuple(i for i, k in enumerate(self.keep) if k)


class ChunkPruner:
    """A stream's pruning state: its threshold (levels; 0: off, every patch kept), the
    merged-patch ``cells`` (gh, gw) of its frames and the last kept patch's signature."""

    def __init__(self, threshold: float, unit: int, cells: tuple[int, int]):
        self.threshold, self.unit, self.cells = threshold, unit, cells
        self.last: torch.Tensor | None = None

    def judge(self, frames: torch.Tensor) -> ChunkKeep:
        """The keep mask of the chunk ``frames`` (uint8 (P * unit, 3, H, W)) against the last
        kept patch; nothing changes until :meth:`commit`."""
        patches = frames.shape[0] // self.unit
        if self.threshold <= 0:
            return ChunkKeep((True,) * patches, None)
        sigs = signatures(frames, self.unit, self.cells)
        if self.last is None:
            keep = keep_mask(sigs, self.threshold)
        else:  # the last kept patch first: always kept, the chunk's judged against it
            keep = keep_mask(torch.cat([self.last.unsqueeze(0), sigs]), self.threshold)[1:]
        kept = [i for i, k in enumerate(keep) if k]
        return ChunkKeep(tuple(keep), sigs[kept[-1]].clone() if kept else self.last)

    def commit(self, chunk: ChunkKeep) -> None:
        """The chunk is held: its last kept patch is the one the next chunk is judged
        against."""
        self.last = chunk.last

    @staticmethod
    def frame_index(chunk: ChunkKeep, unit: int) -> list[int]:
        """The chunk's kept frames' indices among its frames (``unit`` frames a patch)."""
        return [u * unit + j for u in chunk.units for j in range(unit)]
