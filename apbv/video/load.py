"""Loading: probe a file, and decode + resize only one rank's frames (frame parallelism)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from apbv.plan import Range
from apbv.validate import check_int
from apbv.video.bicubic import FAST_MIN_VALUES, frame_resizer
from apbv.video.decoders import _open, _Reader
from apbv.video.frames import DecodedVideo, RankFrames
from apbv.video.gop import frame_split
from apbv.video.sampling import (
    TEMPORAL_PATCH_SIZE,
    Sampling,
    VideoMeta,
    VideoSpec,
    _import,
    plan_sampling,
)

DECODE_CHUNK_ELEMENTS = 1 << 25
"""Frames decoded and resized at once: about this many uint8 values (at least one frame)."""


RESIZE_ONE_BY_ONE = 1 << 16
"""Values per frame (3 x H x W) above which :func:`resize_frames` resizes frame by frame."""


def resize_frames(frames: torch.Tensor, size: Sequence[int], *,
                  processor: bool = False, fast: bool = True) -> torch.Tensor:
    """uint8 (F, 3, H, W) -> (F, 3, h, w) for ``size`` (h, w), as qwen-vl-utils resizes:
    torchvision's bicubic tensor resize with antialiasing (keep the strides qwen-vl-utils
    sees, channels-last from a decoder, for bit-equal frames); ``processor``: as transformers'
    video processors resize (Qwen3-VL's), with torchvision's v2 uint8 kernel instead. CPU
    frames of :data:`apbv.video.bicubic.FAST_MIN_VALUES` values or more go through
    :func:`apbv.video.bicubic.frame_resizer` one at a time (the same bits; ``fast`` False:
    torch's kernel, as the earlier path had it). Other frames over :data:`RESIZE_ONE_BY_ONE`
    values (about 150x150) on the CPU one at a time: the same bits as one call on the batch
    (each output pixel depends on its own frame only), and a 1080p frame's float32 copy
    (25 MB) stays in cache where a batch's does not (about 1.5-2x faster, measured)."""
    on_cpu = frames.device.type == "cpu"
    if fast and on_cpu and not processor and frames.dim() == 4 and frames.shape[0] \
            and frames[0].numel() >= FAST_MIN_VALUES:
        resize_into = frame_resizer((int(frames.shape[2]), int(frames.shape[3])),
                                    (int(size[0]), int(size[1])))
        out = torch.empty((frames.shape[0], 3, *size), dtype=torch.uint8)
        for i in range(frames.shape[0]):
            resize_into(frames[i].permute(1, 2, 0), out[i])
        return out
    functional = _import("torchvision.transforms.v2.functional" if processor
                         else "torchvision.transforms.functional", "torchvision",
                         "frame resizing")

    def resize(batch: torch.Tensor) -> torch.Tensor:
        return functional.resize(batch, list(size),
                                 interpolation=functional.InterpolationMode.BICUBIC,
                                 antialias=True)

    if not on_cpu or frames.shape[0] <= 1 or frames[0].numel() <= RESIZE_ONE_BY_ONE:
        return resize(frames)
    return torch.cat([resize(frames[i:i + 1]) for i in range(frames.shape[0])])


_SAME_FRAMES = ("path", "decode", "decode_threads")
"""VideoSpec fields left out of :func:`video_identity`: the path (resolved there) and the
decoding knobs, which never change the frames."""

VideoIdentity = tuple[str, tuple[int, int, int, int], tuple[tuple[str, Any], ...]]


def video_identity(spec: object) -> VideoIdentity | None:
    """What decides the sampled frames of ``spec``, without opening the file: (resolved path,
    (st_dev, st_ino, st_size, st_mtime_ns), (name, value) of every other VideoSpec field);
    None when ``spec`` is no file video (decoded frames, a live stream) or the file cannot be
    stat'ed (loading it then raises its own error)."""
    if not isinstance(spec, VideoSpec):
        return None
    path = os.path.realpath(spec.path)
    try:
        st = os.stat(path)
    except OSError:
        return None
    sampling = tuple((f.name, getattr(spec, f.name)) for f in dataclasses.fields(spec)
                     if f.name not in _SAME_FRAMES)
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


def _resized_chunks(reader: _Reader, indices: Sequence[int], sampling: Sampling,
                    frames_per_chunk: int | None = None,
                    device: torch.device | None = None) -> Iterator[torch.Tensor]:
    """Decode ``indices`` and resize them, a chunk at a time: uint8 (k, 3, H', W') each, k at
    most ``frames_per_chunk`` (rounded down to whole temporal patches) and at most what keeps
    one decoded chunk near 32 Mi values. ``device``: resized there (the decoded uint8 frames
    are copied to it first); default the CPU, bit-equal to qwen-vl-utils."""
    height, width = sampling.resized_height, sampling.resized_width
    meta = reader.meta
    values = 3 * max(meta.height * meta.width, height * width)
    chunk = max(1, DECODE_CHUNK_ELEMENTS // values)
    if frames_per_chunk is not None:
        unit = sampling.temporal_patch_size
        chunk = max(unit, min(chunk, frames_per_chunk))
        chunk -= chunk % unit
    reader.expect(indices)
    if device is None and reader.per_frame and not sampling.processor_resize:
        # frame by frame into one buffer: the pixels of resize_frames' default kernel only
        yield from _resized_one_by_one(reader, indices, (height, width), chunk)
        return
    for start in range(0, len(indices), chunk):
        frames = reader.read(indices[start:start + chunk])  # (k, H, W, 3)
        assert frames.dtype == torch.uint8 and frames.shape[-1] == 3, (frames.shape, frames.dtype)
        _check_size(reader, frames.shape[1:3])
        # (k, 3, H, W) with channels-last strides, exactly the tensor qwen-vl-utils resizes.
        frames = frames.permute(0, 3, 1, 2)
        if device is not None:
            frames = frames.to(device)
        # video.decode=all and device resizes: the earlier path, torch's kernel
        yield resize_frames(frames, (height, width), processor=sampling.processor_resize,
                            fast=False)


def _check_size(reader: _Reader, shape: Sequence[int]) -> None:
    """ValueError when a decoded frame's (H, W) is not the size the file was opened with."""
    meta = reader.meta
    if tuple(shape) != (meta.height, meta.width):
        raise ValueError(f"video {reader.path!r} changes its frame size mid-stream: "
                         f"{shape[1]}x{shape[0]} instead of {meta.width}x{meta.height}")


def _resized_one_by_one(reader: _Reader, indices: Sequence[int], size: tuple[int, int],
                        chunk: int) -> Iterator[torch.Tensor]:
    """:func:`_resized_chunks` on the CPU for ``video.decode=needed``: each frame resized as it
    is decoded (:func:`apbv.video.bicubic.frame_resizer`: the pixels of :func:`resize_frames`),
    in chunks of ``chunk`` frames, uint8 (k, 3, h, w) each."""
    meta = reader.meta
    resize = frame_resizer((meta.height, meta.width), size)
    for start in range(0, len(indices), chunk):
        part = indices[start:start + chunk]
        out = torch.empty((len(part), 3, *size), dtype=torch.uint8)
        for k, frame in enumerate(reader.frames(part)):
            assert frame.dtype == torch.uint8 and frame.shape[-1] == 3, frame.shape
            _check_size(reader, frame.shape[:2])
            resize(frame, out[k])
        yield out


def _decode_resized(reader: _Reader, indices: Sequence[int], sampling: Sampling,
                    device: torch.device | None = None) -> torch.Tensor:
    """Decode ``indices`` and resize them (on ``device``): uint8 (len(indices), 3, H', W')."""
    out = torch.empty((len(indices), 3, sampling.resized_height, sampling.resized_width),
                      dtype=torch.uint8, device=device)
    start = 0
    for resized in _resized_chunks(reader, indices, sampling, device=device):
        out[start:start + len(resized)] = resized
        start += len(resized)
    return out


class FrameChunks:
    """One rank's frames, decoded and resized only as they are iterated, in chunks of whole
    temporal patches (uint8 (k, 3, H', W'), in order): the vision work can start on the first
    chunk while later ones decode, and no more than a chunk or two is held at once. The
    decoder is closed at the end of the iteration, on error, or by :meth:`close`."""

    def __init__(self, reader: _Reader, indices: Sequence[int], sampling: Sampling,
                 frames_per_chunk: int, device: torch.device | None = None) -> None:
        self._reader: _Reader | None = reader
        self._args = (indices, sampling, frames_per_chunk, device)

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self._reader is None:
            raise RuntimeError("the frames were already read (or closed)")
        try:
            yield from _resized_chunks(self._reader, *self._args)
        finally:
            self.close()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


Planner = Callable[[VideoSpec, VideoMeta], Sampling]
"""A model family's sampling rule: (spec, the file's meta) -> :class:`Sampling`
(default :func:`apbv.video.sampling.plan_sampling`, qwen-vl-utils' rules)."""


def _open_rank(spec: VideoSpec, rank: int, world_size: int,
               before_decode: Callable[[Sampling], None] | None,
               planner: Planner = plan_sampling,
               ) -> tuple[_Reader, Sampling, Range]:
    """The open decoder, the global sampling and ``rank``'s temporal patches, checked (see
    :func:`load_rank_frames`); the decoder is closed when any check fails."""
    check_int("world_size", world_size, 1)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    reader = _open(spec, world_size)
    try:
        sampling = planner(spec, reader.meta)
        try:
            patches = frame_split(sampling, world_size)[rank]
        except ValueError as err:
            raise ValueError(
                f"video {spec.path!r}: {err} ({sampling.num_frames} frames sampled at "
                f"{sampling.sample_fps:.4g} fps from {reader.meta.total_frames} frames)"
            ) from err
        if before_decode is not None:
            before_decode(sampling)
    except BaseException:
        reader.close()
        raise
    return reader, sampling, patches


def rank_frame_chunks(
    spec: VideoSpec, rank: int, world_size: int, *,
    frames_per_chunk: Callable[[int, int], int],
    before_decode: Callable[[Sampling], None] | None = None,
    device: torch.device | None = None, planner: Planner = plan_sampling,
) -> tuple[Sampling, Range, FrameChunks]:
    """:func:`load_rank_frames` without decoding yet: the sampling, ``rank``'s temporal
    patches, and its frames as :class:`FrameChunks` of at most ``frames_per_chunk(resized
    height, resized width)`` frames, resized on ``device``. The same checks, errors and
    ``before_decode`` run here, before any frame is decoded; ``planner``: the family's
    sampling rule."""
    reader, sampling, patches = _open_rank(spec, rank, world_size, before_decode, planner)
    first, last = (sampling.temporal_patch_size * p for p in patches)
    size = frames_per_chunk(sampling.resized_height, sampling.resized_width)
    return sampling, patches, FrameChunks(reader, sampling.indices[first:last], sampling, size,
                                          device)


def load_rank_frames(
    spec: VideoSpec, rank: int, world_size: int, *,
    before_decode: Callable[[Sampling], None] | None = None,
    device: torch.device | None = None, planner: Planner = plan_sampling,
) -> RankFrames:
    """Decode and resize only the frames of ``rank``'s temporal patches (frame parallelism).

    Every rank probes the file and plans the sampling itself (same file, same result), so the
    resize target is the global one and the ranks' frames, concatenated in rank order, equal
    :func:`load_all_frames`. Errors are raised before any decoding and are the same on every
    rank: see :func:`probe`, :func:`plan_sampling`, and fewer temporal patches than ranks.
    ``before_decode(sampling)`` runs once the sampling is known and before any frame is
    decoded (the engine's preflight: prompt length and memory); its error stops the load.
    ``device``: where the frames are resized and returned (default the CPU: qwen-vl-utils'
    pixels bit for bit; a GPU rounds differently). ``planner``: the model family's sampling
    rule (:data:`Planner`).
    """
    reader, sampling, patches = _open_rank(spec, rank, world_size, before_decode, planner)
    try:
        first, last = (sampling.temporal_patch_size * p for p in patches)
        frames = _decode_resized(reader, sampling.indices[first:last], sampling, device)
    finally:
        reader.close()
    return RankFrames(frames, patches, sampling, rank, world_size)


def decoded_rank_frames(
    video: DecodedVideo, rank: int, world_size: int, *,
    before_process: Callable[[Sampling], None] | None = None,
    temporal_patch_size: int = TEMPORAL_PATCH_SIZE,
) -> RankFrames:
    """:func:`load_rank_frames` for frames already decoded and resized: this rank's share of
    the temporal patches of ``temporal_patch_size`` frames (the model family's; views, no
    copy). ``before_process`` as ``before_decode`` there."""
    sampling = dataclasses.replace(video.sampling, temporal_patch_size=temporal_patch_size)
    try:
        patches = frame_split(sampling, world_size)[rank]
    except ValueError as err:
        raise ValueError(f"decoded video {video.identity()}: {err}") from err
    if before_process is not None:
        before_process(sampling)
    first, last = (sampling.temporal_patch_size * p for p in patches)
    return RankFrames(video.frames[first:last], patches, sampling, rank, world_size)


def load_all_frames(spec: VideoSpec) -> RankFrames:
    """The whole sampled video in one process: :func:`load_rank_frames` with rank 0 of 1.

    ``result.frames.float()`` equals qwen-vl-utils' ``fetch_video`` tensor (T*2, 3, H', W').
    """
    return load_rank_frames(spec, 0, 1)
