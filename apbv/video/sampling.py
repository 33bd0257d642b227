"""The data types of the video stage and the pure sampling rules (qwen-vl-utils' own).

:func:`plan_sampling` is a pure function of (:class:`VideoSpec`, :class:`VideoMeta`); see
:mod:`apbv.video` for the rules and where they come from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from apbv import import_extra
from apbv.config import VIDEO_BACKENDS as BACKENDS
from apbv.config import VIDEO_DECODE_MODES as DECODE_MODES
from apbv.config import VIDEO_DEVICE_BACKENDS as DEVICE_BACKENDS
from apbv.validate import check_int, positive

TEMPORAL_PATCH_SIZE = 2
"""Frames per temporal patch of Qwen2.5-VL's vision tower (qwen-vl-utils' FRAME_FACTOR)."""

# ---------------------------------------------------------------------------------------------
# Lazy imports of the optional `video` extra.


def _import(module: str, package: str, purpose: str) -> ModuleType:
    return import_extra(module, package=package, extra="video", purpose=purpose)


def _qwen() -> ModuleType:
    """qwen_vl_utils.vision_process (the reference sampling rules)."""
    return _import("qwen_vl_utils.vision_process", "qwen-vl-utils", "frame sampling")


# ---------------------------------------------------------------------------------------------
# Value checks.




# ---------------------------------------------------------------------------------------------
# Public data types.


@dataclass(frozen=True)
class VideoSpec:
    """One video and how to sample it: qwen-vl-utils' ``fetch_video`` keys, plus the decoder.

    ``None`` means qwen-vl-utils' default for that key. Exactly one of ``fps`` and ``nframes``
    sets the frame count; with neither, 2 frames per second are sampled.
    """

    path: str
    """Local video file (``os.PathLike`` is accepted and stored as ``str``)."""
    fps: float | None = None
    """Frames to sample per second of video; None: 2.0 (qwen-vl-utils' FPS) unless nframes."""
    nframes: int | None = None
    """Fixed number of frames to sample, rounded to a multiple of 2 with Python's ``round``."""
    min_frames: int = 4
    """With fps: at least this many frames (rounded up to a multiple of 2)."""
    max_frames: int | None = None
    """With fps: at most this many frames; None: min(768, frames in the range)."""
    min_pixels: int | None = None
    """Per-frame pixel floor; None: 128 tokens = 128 * 28**2 pixels (patch 14), or max_pixels
    when that is given and lower (qwen-vl-utils fails there; see :func:`plan_sampling`)."""
    max_pixels: int | None = None
    """Per-frame pixel cap, lowered further by total_pixels; None: 768 * 28**2 (patch 14)."""
    total_pixels: float | None = None
    """Pixel budget of the whole video; None: env MODEL_SEQ_LEN (128000) * 28**2 * 0.9."""
    video_start: float | None = None
    """Start of the clip in seconds (None: the first frame)."""
    video_end: float | None = None
    """End of the clip in seconds (None: the last frame)."""
    backend: str = "decord"
    """Decoder: one of :data:`BACKENDS` or :data:`DEVICE_BACKENDS`. There is no fallback from
    one to another."""
    image_patch_size: int = 14
    """ViT patch size; frames are resized to multiples of ``image_patch_size * 2``."""
    resized_height: int | None = None
    """With resized_width: resize every frame to about this size instead (rounded to multiples
    of ``image_patch_size * 2``; the pixel settings are then not used), as qwen-vl-utils."""
    resized_width: int | None = None
    """With resized_height: see there."""
    decode: str = "needed"
    """One of :data:`DECODE_MODES`. Both modes seek to the keyframe before a sampled frame
    unless the decoder is already on its way there and stop at the last sampled frame.
    ``needed`` (PyAV): the frames nothing refers to are skipped unless sampled, and the open
    checks truncation from the packet index without decoding the last frame; on the CPU each
    frame is resized as it is decoded (:func:`apbv.video.bicubic.frame_resizer`). ``all``:
    every coded frame on the way, the last frame at open, and chunks of stacked frames
    resized (the earlier reader and conversion; for comparisons). decord decodes the same way
    in both. The frames are the same bit for bit."""
    decode_threads: int | None = None
    """Decoder threads; None: the process's cores divided by the ranks (at least 1)."""
    snap_to_keyframes: float | None = None
    """Seconds (opt-in, approximate sampling): a sampled frame that lies within this of a
    keyframe is replaced by the nearest keyframe, which decodes alone instead of after the
    frames before it; :attr:`Sampling.moved` lists the frames that moved. None: exact."""
    keyframe_split: bool = False
    """Split the frames over the ranks at keyframe intervals (:func:`apbv.video.gop.frame_split`,
    at most one temporal patch from the balanced split) instead of the balanced split; needs
    the file's keyframe index. The same frames and tokens."""
    follow_symlinks: bool = True
    """False: open the file without following a symbolic link anywhere on ``path`` (a link is
    an error), and decode the file so opened whatever the path is swapped for meanwhile (the
    server's choice for clients' paths, checked against its media roots first)."""

    def __post_init__(self) -> None:
        path = self.path
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a non-empty str or os.PathLike, got {self.path!r}")
        object.__setattr__(self, "path", path)
        if not isinstance(self.follow_symlinks, bool):
            raise ValueError(f"follow_symlinks must be a bool, got {self.follow_symlinks!r}")
        if not isinstance(self.keyframe_split, bool):
            raise ValueError(f"keyframe_split must be a bool, got {self.keyframe_split!r}")
        if self.backend not in BACKENDS + DEVICE_BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or {DEVICE_BACKENDS[0]!r} "
                             f"(a GPU's), got {self.backend!r}")
        if self.decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {DECODE_MODES}, got {self.decode!r}")
        if self.decode_threads is not None:
            check_int("decode_threads", self.decode_threads, 1)
        if self.snap_to_keyframes is not None:
            positive("snap_to_keyframes", self.snap_to_keyframes)
        if self.fps is not None and self.nframes is not None:
            raise ValueError(
                f"fps and nframes are mutually exclusive (got fps={self.fps!r}, "
                f"nframes={self.nframes!r}); give one of them"
            )
        if self.fps is not None:
            positive("fps", self.fps)
        if self.nframes is not None:
            check_int("nframes", self.nframes, TEMPORAL_PATCH_SIZE)
        check_int("min_frames", self.min_frames, 1)
        if self.max_frames is not None:
            check_int("max_frames", self.max_frames, TEMPORAL_PATCH_SIZE)
            if self.max_frames < self.min_frames:
                raise ValueError(
                    f"max_frames ({self.max_frames}) must be >= min_frames ({self.min_frames})"
                )
        if self.min_pixels is not None:
            check_int("min_pixels", self.min_pixels, 1)
        if self.max_pixels is not None:
            check_int("max_pixels", self.max_pixels, 1)
            if self.min_pixels is not None and self.max_pixels < self.min_pixels:
                raise ValueError(
                    f"max_pixels ({self.max_pixels}) must be >= min_pixels ({self.min_pixels})"
                )
        if self.total_pixels is not None:
            positive("total_pixels", self.total_pixels)
        if self.video_start is not None:
            positive("video_start", self.video_start, allow_zero=True)
        if self.video_end is not None:
            positive("video_end", self.video_end, allow_zero=True)
            if self.video_start is not None and self.video_end <= self.video_start:
                raise ValueError(
                    f"video_end ({self.video_end}) must be > video_start ({self.video_start})"
                )
        check_int("image_patch_size", self.image_patch_size, 1)
        if (self.resized_height is None) != (self.resized_width is None):
            raise ValueError(
                f"resized_height and resized_width go together (got resized_height="
                f"{self.resized_height!r}, resized_width={self.resized_width!r}); give both"
            )
        if self.resized_height is not None:
            check_int("resized_height", self.resized_height, 1)
            check_int("resized_width", self.resized_width, 1)

    def qwen_element(self) -> dict[str, Any]:
        """The equivalent qwen-vl-utils video element (only the keys that are set)."""
        ele: dict[str, Any] = {"video": self.path}
        for key in ("fps", "nframes", "max_frames", "min_pixels", "max_pixels", "total_pixels",
                    "video_start", "video_end", "resized_height", "resized_width"):
            value = getattr(self, key)
            if value is not None:
                ele[key] = value
        ele["min_frames"] = self.min_frames
        return ele


@dataclass(frozen=True)
class VideoMeta:
    """What :func:`probe` reads from the file (the same on every rank)."""

    total_frames: int
    """Frames in the file as the decoder indexes them (the index space of frame indices)."""
    fps: float
    """Native (average) frame rate."""
    height: int
    """Decoded frame height in pixels."""
    width: int
    """Decoded frame width in pixels."""
    keyframes: tuple[int, ...] | None = field(default=None, compare=False)
    """Frame indices of the keyframes, ascending, when the decoder lists them."""

    def __post_init__(self) -> None:
        check_int("total_frames", self.total_frames, 1)
        positive("fps", self.fps)
        check_int("height", self.height, 1)
        check_int("width", self.width, 1)

    @property
    def duration(self) -> float:
        """Seconds: total_frames / fps."""
        return self.total_frames / self.fps


@dataclass(frozen=True)
class Sampling:
    """The frames of one video the model sees, and their size. Build it with plan_sampling."""

    indices: tuple[int, ...]
    """Sampled frame indices into the file, non-decreasing; their count is a multiple of 2."""
    sample_fps: float
    """Sampled frames per second, as qwen-vl-utils reports it (``fps`` for the processor)."""
    resized_height: int
    """Height every frame is resized to (a multiple of image_patch_size * 2)."""
    resized_width: int
    """Width every frame is resized to (a multiple of image_patch_size * 2)."""
    image_patch_size: int = 14
    """ViT patch size the sizes were computed for."""
    moved: tuple[tuple[int, int, int], ...] = ()
    """With :attr:`VideoSpec.snap_to_keyframes`: (position among the sampled frames, frame
    index the rule gave, keyframe index taken instead) of every sampled frame that moved."""
    temporal_patch_size: int = TEMPORAL_PATCH_SIZE
    """Frames per temporal unit of the vision tower (Qwen2.5-VL 2; InternVL3 1: whole
    frames); ranks split the video by whole units."""
    keyframes: tuple[int, ...] | None = field(default=None, repr=False)
    """With :attr:`VideoSpec.keyframe_split`: the file's keyframe indices, which place the
    ranks' split (:func:`apbv.video.gop.frame_split`); None: the balanced split."""
    video_fps: float | None = None
    """The file's frame rate where the prompt needs it (Qwen3-VL's timestamps), else None."""
    processor_resize: bool = False
    """Resize as transformers' video processors do (Qwen3-VL), not as qwen-vl-utils does."""

    def __post_init__(self) -> None:
        assert len(self.indices) % self.temporal_patch_size == 0 and self.indices, self.indices

    @property
    def num_frames(self) -> int:
        return len(self.indices)

    @property
    def num_patches(self) -> int:
        """T: temporal patches (runs of ``temporal_patch_size`` consecutive sampled frames)."""
        return len(self.indices) // self.temporal_patch_size

    @property
    def second_per_grid_t(self) -> float:
        """Seconds per temporal patch, temporal_patch_size / sample_fps (M-RoPE time step)."""
        return self.temporal_patch_size / self.sample_fps

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        """(T, height / patch, width / patch): the processor's ``video_grid_thw`` row."""
        p = self.image_patch_size
        return self.num_patches, self.resized_height // p, self.resized_width // p


# ---------------------------------------------------------------------------------------------
# Pure planning.


def plan_sampling(spec: VideoSpec, meta: VideoMeta) -> Sampling:
    """Frame indices, sample fps and resize target by qwen-vl-utils' rules; pure given meta.

    Raises ValueError naming the file when the clip is too short to sample 2 frames, or the
    requested time range or sizes are impossible.
    """
    vp = _qwen()
    ele = spec.qwen_element()
    where = f"video {spec.path!r}"
    try:
        start, end, count = vp.calculate_video_frame_range(ele, meta.total_frames, meta.fps)
        nframes = vp.smart_nframes(ele, total_frames=count, video_fps=meta.fps)
    except ValueError as err:
        raise ValueError(
            f"{where}: cannot sample frames from {meta.total_frames} frames at {meta.fps:g} fps "
            f"({meta.duration:.2f} s) with video_start={spec.video_start}, "
            f"video_end={spec.video_end}: {err}"
        ) from err
    # As qwen-vl-utils' readers (default float32 linspace, round half to even).
    indices = torch.linspace(start, end, nframes, dtype=torch.float32).round().long().tolist()
    sample_fps = nframes / max(count, 1e-6) * meta.fps
    height, width = _resize_target(vp, spec, meta.height, meta.width, nframes, where)
    if spec.keyframe_split and meta.keyframes is None:
        raise ValueError(f"{where}: keyframe_split needs the file's keyframe index, which "
                         f"{spec.backend} does not give for it")
    indices, moved = snapped(indices, spec, meta, where)
    return Sampling(tuple(indices), sample_fps, height, width, spec.image_patch_size, moved,
                    keyframes=meta.keyframes if spec.keyframe_split else None)


def snapped(indices: list[int], spec: VideoSpec, meta: VideoMeta, where: str,
            ) -> tuple[list[int], tuple[tuple[int, int, int], ...]]:
    """``indices`` as :attr:`VideoSpec.snap_to_keyframes` asks (unset: unchanged, nothing
    moved; see :func:`snap_to_keyframes`), or ValueError naming ``where`` when the decoder gave
    no keyframe index."""
    if spec.snap_to_keyframes is None:
        return indices, ()
    if meta.keyframes is None:
        raise ValueError(f"{where}: snap_to_keyframes needs the file's keyframe index, "
                         f"which {spec.backend} does not give for it")
    return snap_to_keyframes(indices, meta.keyframes, spec.snap_to_keyframes * meta.fps)


def snap_to_keyframes(indices: list[int], keyframes: tuple[int, ...], tolerance: float,
                      ) -> tuple[list[int], tuple[tuple[int, int, int], ...]]:
    """Each of ``indices`` (non-decreasing) replaced by its nearest keyframe (the earlier one
    on a tie) when that lies within ``tolerance`` frames; the result stays non-decreasing.
    Returns the indices and the (position, index, keyframe) of each one that moved."""
    import bisect

    out, moved = [], []
    for position, index in enumerate(indices):
        k = bisect.bisect_left(keyframes, index)
        near = [keyframes[j] for j in (k - 1, k) if 0 <= j < len(keyframes)]
        key = min(near, key=lambda f: (abs(f - index), f)) if near else index
        if key != index and abs(key - index) <= tolerance:
            moved.append((position, index, key))
            index = key
        out.append(index)
    return out, tuple(moved)


def _resize_target(
    vp: ModuleType, spec: VideoSpec, height: int, width: int, nframes: int, where: str
) -> tuple[int, int]:
    """qwen-vl-utils' fetch_video size rule for nframes frames of height x width.

    One extension: a max_pixels below the default min_pixels (min_pixels not given) lowers the
    floor to max_pixels, so the cap wins; qwen-vl-utils fails there (smart_resize asserts
    max_pixels >= min_pixels). The result equals fetch_video with min_pixels = max_pixels.
    """
    factor = spec.image_patch_size * vp.SPATIAL_MERGE_SIZE
    frame_min = vp.VIDEO_MIN_TOKEN_NUM * factor * factor
    frame_max = vp.VIDEO_MAX_TOKEN_NUM * factor * factor
    min_pixels = spec.min_pixels if spec.min_pixels is not None else frame_min
    if spec.min_pixels is None and spec.max_pixels is not None:
        min_pixels = min(min_pixels, spec.max_pixels)
    total_pixels = spec.total_pixels
    if total_pixels is None:
        total_pixels = vp.MODEL_SEQ_LEN * factor * factor * 0.9
    cap = total_pixels / nframes * vp.FRAME_FACTOR  # the video's budget shared by its frames
    max_pixels = max(min(frame_max, cap), int(min_pixels * 1.05))
    if spec.max_pixels is not None:
        max_pixels = min(spec.max_pixels, max_pixels)
    settings = (f"min_pixels={min_pixels}, max_pixels={max_pixels:g} (after the total_pixels "
                f"cap), total_pixels={total_pixels:g}, {nframes} frames, factor {factor}")
    if spec.resized_height is not None:
        height, width = spec.resized_height, spec.resized_width
        settings = f"resized_height={height}, resized_width={width}, factor {factor}"
        min_pixels = max_pixels = None  # smart_resize's image defaults, as fetch_video
    elif max_pixels < min_pixels:  # unreachable: VideoSpec checks max_pixels >= min_pixels
        raise ValueError(f"{where}: max_pixels ({max_pixels}) is below min_pixels ({min_pixels})")
    try:
        out = vp.smart_resize(height, width, factor, min_pixels=min_pixels, max_pixels=max_pixels)
    except ValueError as err:  # aspect ratio beyond qwen-vl-utils' MAX_RATIO
        raise ValueError(f"{where}: frames of {width}x{height} cannot be resized: {err}") from err
    new_height, new_width = out
    if new_height < factor or new_width < factor:  # 0: the resize itself would fail
        raise ValueError(
            f"{where}: frames of {width}x{height} would be resized to {new_width}x{new_height} "
            f"pixels ({settings}); every side must be at least {factor}: raise max_pixels or "
            "total_pixels, or use a video with a less extreme aspect ratio"
        )
    return new_height, new_width


_NO_TOTAL_CAP = 1e300
"""A total_pixels budget no frame size reaches: the per-frame bounds alone decide the size."""


def stream_frame_size(height: int, width: int, *, min_pixels: int | None = None,
                      max_pixels: int | None = None, image_patch_size: int = 14
                      ) -> tuple[int, int]:
    """(h, w), multiples of ``image_patch_size * 2``, that every frame of a stream of native
    ``height`` x ``width`` frames is resized to.

    The one-shot path's per-frame rule (qwen-vl-utils' smart_resize with its video pixel
    bounds, and the same extension: a ``max_pixels`` below the default floor lowers the floor),
    without the ``total_pixels`` cap, which shares a budget over a whole video of known length
    and has no meaning for a stream: only the per-frame ``min_pixels`` / ``max_pixels`` bound it.
    ValueError for bad values or an aspect ratio qwen-vl-utils refuses.
    """
    for name, value in (("height", height), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    spec = VideoSpec("<stream>", min_pixels=min_pixels, max_pixels=max_pixels,
                     total_pixels=_NO_TOTAL_CAP, image_patch_size=image_patch_size)
    return _resize_target(_qwen(), spec, height, width, 2, "stream")
