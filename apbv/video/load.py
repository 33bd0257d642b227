"""Loading: probe a file, and decode + resize only one rank's frames (frame parallelism)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from apbv.plan import check_int, patch_ranges
from apbv.video.decoders import _open, _Reader
from apbv.video.sampling import (
    TEMPORAL_PATCH_SIZE,
    DecodedVideo,
    RankFrames,
    Sampling,
    VideoMeta,
    VideoSpec,
    _import,
    plan_sampling,
)

_CHUNK_ELEMENTS = 1 << 25  # decode + resize at most ~32 Mi uint8 values (one float copy) at once


def resize_frames(frames: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """uint8 (F, 3, H, W) -> (F, 3, h, w) for ``size`` (h, w), as qwen-vl-utils resizes:
    torchvision's bicubic tensor resize with antialiasing (keep the strides qwen-vl-utils
    sees, channels-last from a decoder, for bit-equal frames)."""
    functional = _import("torchvision.transforms.functional", "torchvision", "frame resizing")
    return functional.resize(frames, list(size),
                             interpolation=functional.InterpolationMode.BICUBIC, antialias=True)


VideoIdentity = tuple[str, tuple[int, int, int, int], tuple[tuple[str, Any], ...]]


def video_identity(spec: VideoSpec) -> VideoIdentity | None:
    """What decides the sampled frames of ``spec``, without opening the file: (resolved path,
    (st_dev, st_ino, st_size, st_mtime_ns), (name, value) of every other VideoSpec field);
    None when the file cannot be stat'ed (loading it then raises its own error)."""
    path = os.path.realpath(spec.path)
    try:
        st = os.stat(path)
    except OSError:
        return None
    sampling = tuple((f.name, getattr(spec, f.name)) for f in dataclasses.fields(spec)
                     if f.name != "path")
    return path, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), sampling


def probe(spec: VideoSpec) -> VideoMeta:
    """Open and check the file with ``spec.backend``; return its frame count, fps and size.

    ValueError naming the file when it is missing, not a regular file, unreadable, has no
    video stream or no frames, or is truncated or corrupt (the last frame in its index must
    decode). ImportError naming the ``video`` extra when the decoder is not installed.
    """
    reader = _open(spec)
    try:
        return reader.meta
    finally:
        reader.close()


def _decode_resized(reader: _Reader, indices: Sequence[int], sampling: Sampling) -> torch.Tensor:
    """Decode ``indices`` and resize them: uint8 (len(indices), 3, H', W')."""
    height, width = sampling.resized_height, sampling.resized_width
    out = torch.empty((len(indices), 3, height, width), dtype=torch.uint8)
    meta = reader.meta
    per_frame = 3 * max(meta.height * meta.width, height * width)
    chunk = max(1, _CHUNK_ELEMENTS // per_frame)
    for start in range(0, len(indices), chunk):
        frames = reader.read(indices[start:start + chunk])  # (k, H, W, 3)
        assert frames.dtype == torch.uint8 and frames.shape[-1] == 3, (frames.shape, frames.dtype)
        if frames.shape[1:3] != (meta.height, meta.width):
            raise ValueError(
                f"video {reader.path!r} changes its frame size mid-stream: "
                f"{frames.shape[2]}x{frames.shape[1]} instead of {meta.width}x{meta.height}"
            )
        # (k, 3, H, W) with channels-last strides, exactly the tensor qwen-vl-utils resizes.
        frames = frames.permute(0, 3, 1, 2)
        resized = resize_frames(frames, (height, width))
        out[start:start + len(resized)] = resized
    return out


def load_rank_frames(
    spec: VideoSpec, rank: int, world_size: int, *,
    before_decode: Callable[[Sampling], None] | None = None,
) -> RankFrames:
    """Decode and resize only the frames of ``rank``'s temporal patches (frame parallelism).

    Every rank probes the file and plans the sampling itself (same file, same result), so the
    resize target is the global one and the ranks' frames, concatenated in rank order, equal
    :func:`load_all_frames`. Errors are raised before any decoding and are the same on every
    rank: see :func:`probe`, :func:`plan_sampling`, and fewer temporal patches than ranks.
    ``before_decode(sampling)`` runs once the sampling is known and before any frame is
    decoded (the engine's preflight: prompt length and memory); its error stops the load.
    """
    check_int("world_size", world_size, 1)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    reader = _open(spec)
    try:
        sampling = plan_sampling(spec, reader.meta)
        try:
            patches = patch_ranges(sampling.num_patches, world_size)[rank]
        except ValueError as err:
            raise ValueError(
                f"video {spec.path!r}: {err} ({sampling.num_frames} frames sampled at "
                f"{sampling.sample_fps:.4g} fps from {reader.meta.total_frames} frames)"
            ) from err
        if before_decode is not None:
            before_decode(sampling)
        first, last = (TEMPORAL_PATCH_SIZE * p for p in patches)
        frames = _decode_resized(reader, sampling.indices[first:last], sampling)
    finally:
        reader.close()
    return RankFrames(frames, patches, sampling, rank, world_size)


def decoded_rank_frames(
    video: DecodedVideo, rank: int, world_size: int, *,
    before_process: Callable[[Sampling], None] | None = None,
) -> RankFrames:
    """:func:`load_rank_frames` for frames already decoded and resized: this rank's share of
    the temporal patches (views, no copy). ``before_process`` as ``before_decode`` there."""
    sampling = video.sampling
    try:
        patches = patch_ranges(sampling.num_patches, world_size)[rank]
    except ValueError as err:
        raise ValueError(f"decoded video {video.identity()}: {err}") from err
    if before_process is not None:
        before_process(sampling)
    first, last = (TEMPORAL_PATCH_SIZE * p for p in patches)
    return RankFrames(video.frames[first:last], patches, sampling, rank, world_size)


def load_all_frames(spec: VideoSpec) -> RankFrames:
    """The whole sampled video in one process: :func:`load_rank_frames` with rank 0 of 1.

    ``result.frames.float()`` equals qwen-vl-utils' ``fetch_video`` tensor (T*2, 3, H', W').
    """
    return load_rank_frames(spec, 0, 1)
