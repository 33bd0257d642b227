"""Decode work of a frame split from the file's keyframe structure (pure).

A decoder reaches sampled frame ``i`` by starting at the keyframe before it and walking every
coded frame up to it. For one rank (:func:`walked_frames`): each keyframe interval holding some
of its sampled frames costs the frames from that keyframe to the last of them. Two ranks whose
shares meet inside one keyframe interval both walk its start (:func:`shared_intervals`).

:func:`keyframe_aligned_ranges` moves each boundary of :func:`apbv.plan.patch_ranges` by at
most one temporal patch to a place where the two ranks' frames fall in different keyframe
intervals, where there is one; no boundary moves otherwise. :func:`frame_split` is the split
the engine decodes, encodes and routes embeddings by: this one with ``video.keyframe_split``,
the balanced one otherwise (routing moves every embedding row to its owner either way).

``keyframes``: ascending frame indices (0-based, in the decoder's index space) of the keyframes;
``indices``: the sampled frame indices (non-decreasing); ranges are in temporal patches.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple

from apbv.plan import Range, patch_ranges
from apbv.video.sampling import TEMPORAL_PATCH_SIZE, Sampling, VideoMeta


def interval_of(keyframes: Sequence[int], frame: int) -> int:
    """The keyframe that starts ``frame``'s interval (0 before the first keyframe)."""
    k = bisect.bisect_right(keyframes, frame) - 1
    return keyframes[k] if k >= 0 else 0


class Walk(NamedTuple):
    """A decoder's way to some sampled frames: ``frames`` coded frames walked (the sampled ones
    included) in ``intervals`` keyframe intervals (each a seek and a keyframe)."""

    frames: int
    intervals: int


def walk(keyframes: Sequence[int], frames: Sequence[int]) -> Walk:
    """The :class:`Walk` to ``frames`` (ascending): per keyframe interval holding some, from
    its keyframe to the last of them."""
    last: dict[int, int] = {}
    for frame in frames:
        last[interval_of(keyframes, frame)] = frame
    return Walk(sum(end - start + 1 for start, end in last.items()), len(last))


def walked_frames(keyframes: Sequence[int], frames: Sequence[int]) -> int:
    """Coded frames walked to decode ``frames``: :func:`walk`'s ``frames``."""
    return walk(keyframes, frames).frames


def _frames(indices: Sequence[int], patches: Range, unit: int) -> Sequence[int]:
    return indices[unit * patches[0]:unit * patches[1]]


def rank_walks(keyframes: Sequence[int], indices: Sequence[int], ranges: Sequence[Range],
               unit: int = TEMPORAL_PATCH_SIZE) -> list[Walk]:
    """:func:`walk` of each rank's share (``ranges`` in temporal patches of ``unit`` frames:
    the family's, 1 for InternVL3)."""
    return [walk(keyframes, _frames(indices, r, unit)) for r in ranges]


def shared_intervals(keyframes: Sequence[int], indices: Sequence[int],
                     ranges: Sequence[Range], unit: int = TEMPORAL_PATCH_SIZE) -> int:
    """Keyframe intervals that more than one rank walks into."""
    owners: dict[int, set[int]] = {}
    for rank, r in enumerate(ranges):
        for frame in _frames(indices, r, unit):
            owners.setdefault(interval_of(keyframes, frame), set()).add(rank)
    return sum(len(ranks) > 1 for ranks in owners.values())


def keyframe_aligned_ranges(keyframes: Sequence[int], indices: Sequence[int],
                            world_size: int, unit: int = TEMPORAL_PATCH_SIZE) -> list[Range]:
    """:func:`apbv.plan.patch_ranges` with each inner boundary moved by at most one temporal
    patch (``unit`` frames) to the nearest place where the frames before and after it lie in
    different keyframe intervals; a boundary with no such place stays. Every rank keeps at
    least one patch and at most one more than the balanced split's largest share (the slowest
    rank's)."""
    assert len(indices) % unit == 0 and indices, (len(indices), unit)
    ranges = patch_ranges(len(indices) // unit, world_size)
    bounds = [start for start, _ in ranges] + [ranges[-1][1]]

    def clean(b: int) -> bool:
        frame = unit * b
        return interval_of(keyframes, indices[frame - 1]) != interval_of(keyframes,
                                                                         indices[frame])

    most = max(end - start for start, end in ranges) + 1  # the slowest rank's share at most

    for i in range(1, world_size):
        for b in (bounds[i], bounds[i] - 1, bounds[i] + 1):
            if 0 < b - bounds[i - 1] <= most and 0 < bounds[i + 1] - b <= most and clean(b):
                bounds[i] = b
                break
    return [(bounds[i], bounds[i + 1]) for i in range(world_size)]


def frame_split(sampling: Sampling, world_size: int) -> tuple[Range, ...]:
    """Each rank's temporal patches: :func:`keyframe_aligned_ranges` when ``sampling`` carries
    the file's keyframes (:attr:`apbv.video.VideoSpec.keyframe_split`), else the balanced
    :func:`apbv.plan.patch_ranges`. ValueError (from the latter) with fewer patches than
    ranks."""
    if sampling.keyframes is None:
        return patch_ranges(sampling.num_patches, world_size)
    return tuple(keyframe_aligned_ranges(sampling.keyframes, sampling.indices, world_size,
                                         sampling.temporal_patch_size))


def decode_work(meta: VideoMeta, sampling: Sampling, world_size: int) -> dict[str, int]:
    """The decode work the file's keyframe layout implies for ``sampling`` on ``world_size``
    ranks, as deadline admission prices it: ``source_pixels`` (of one decoded frame) and,
    where the decoder lists the keyframes, ``walked`` and ``intervals`` (the :class:`Walk` of
    the rank that walks the most coded frames to its share under :func:`frame_split`; left out
    with fewer temporal patches than ranks, which the engine refuses) and ``walked_one`` and
    ``intervals_one`` (one decoder's walk to all the sampled frames: a single process, or a
    mode whose every rank decodes every frame)."""
    work = {"source_pixels": meta.height * meta.width}
    keys = meta.keyframes
    if keys is None:
        return work
    indices, unit = sampling.indices, sampling.temporal_patch_size
    work["walked_one"], work["intervals_one"] = walk(keys, indices)
    if sampling.num_patches >= world_size:
        work["walked"], work["intervals"] = max(
            walk(keys, indices[unit * start:unit * end])
            for start, end in frame_split(sampling, world_size))
    return work
