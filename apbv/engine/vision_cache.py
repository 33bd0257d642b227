"""Vision reuse: each rank keeps the vision tower's output for its own share of a video.

A second question about the same video then skips, on that rank, the probe, the frame decoding,
the video processor and the vision tower; the prompt tokens are still built from the question
and the memory preflight still runs. What is kept per entry is only what the video decides:
this rank's embedding rows and the :class:`apbv.video.Sampling` (grid, seconds per temporal
patch, frame count), never anything of the question.

An entry is found by a :class:`VisionKey`: the file's identity (resolved path, device, inode,
size, mtime in ns; a rewritten file is a new key), every sampling setting of the request's
:class:`apbv.video.VideoSpec` but the path, the model (path and dtype), and the rank's place in
the frame split (rank, world size, whether the mode splits the vision work). The cache is a
least-recently-used map under a byte budget per rank, counted exactly from the tensors held; an
entry larger than the whole budget is not stored. Ranks decide hit or miss on their own (one may
have evicted what another kept); the engine's collectives run the same either way.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import torch

from apbv.plan import Range
from apbv.video import Sampling, VideoSpec, video_identity


@dataclass(frozen=True)
class VisionKey:
    """Everything that decides one rank's vision embeddings of one video."""

    path: str
    """The video's resolved path."""
    file: tuple[int, int, int, int]
    """(st_dev, st_ino, st_size, st_mtime_ns) of the resolved path."""
    sampling: tuple[tuple[str, object], ...]
    """(name, value) of every VideoSpec field except the path."""
    model: tuple[str, str]
    """(resolved checkpoint path, dtype of the loaded weights)."""
    rank: int
    world_size: int
    vit_split: bool
    """Whether the ranks split the vision work (the rank's patch range depends on it)."""


def vision_key(spec: VideoSpec, model_path: str, dtype: torch.dtype | str, rank: int,
               world_size: int, vit_split: bool) -> VisionKey | None:
    """The key of ``spec`` on this rank, or None when the file cannot be stat'ed (a miss: the
    loader then raises its own error naming the file)."""
    identity = video_identity(spec)
    if identity is None:
        return None
    path, file, sampling = identity
    return VisionKey(path=path, file=file, sampling=sampling,
                     model=(os.path.realpath(model_path), str(dtype)),
                     rank=rank, world_size=world_size, vit_split=bool(vit_split))


@dataclass(frozen=True)
class VisionEntry:
    """One rank's share of one video, as the vision tower produced it."""

    embeddings: torch.Tensor
    """(rows, hidden): the vision tower's output for this rank's temporal patches."""
    sampling: Sampling
    """The whole video's sampling (grid, second_per_grid_t, num_frames)."""
    patch_range: Range
    """The temporal patches [p0, p1) the rows belong to."""

    @property
    def nbytes(self) -> int:
        """Bytes held by the entry's tensors."""
        return self.embeddings.numel() * self.embeddings.element_size()


class VisionCache:
    """LRU map VisionKey -> VisionEntry under ``budget_bytes`` (0: off, nothing is stored)."""

    def __init__(self, budget_bytes: int):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) \
                or budget_bytes < 0:
            raise ValueError(f"the vision cache budget must be an integer >= 0 bytes, "
                             f"got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[VisionKey, VisionEntry] = OrderedDict()
        self.nbytes = 0
        """Bytes held now (never above the budget)."""
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[VisionKey]:
        """The keys, least recently used first."""
        return list(self._entries)

    def get(self, key: VisionKey | None) -> VisionEntry | None:
        """The entry of ``key`` (now the most recently used), or None; counts a hit or miss."""
        entry = None if key is None else self._entries.get(key)
        if key is None or entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: VisionKey | None, entry: VisionEntry) -> bool:
        """Store ``entry`` as the most recently used, evicting the least recently used ones
        until it fits (entries of an earlier version of the same file go first). An entry
        larger than the budget is not stored (nothing is evicted for it): False."""
        if key is None or entry.nbytes > self.budget_bytes:
            return False
        self.discard(key)
        for old_key in [k for k in self._entries if k.path == key.path and k.file != key.file]:
            self.discard(old_key)  # an earlier version of a rewritten file can never hit again
        while self.nbytes + entry.nbytes > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
            self.evictions += 1
        self._entries[key] = entry
        self.nbytes += entry.nbytes
        return True

    def discard(self, key: VisionKey) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
