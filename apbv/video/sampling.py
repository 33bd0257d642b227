"""The data types of the video stage and the pure sampling rules (qwen-vl-utils' own).

:func:`plan_sampling` is a pure function of (:class:`VideoSpec`, :class:`VideoMeta`); see
:mod:`apbv.video` for the rules and where they come from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch

from apbv import import_extra
from apbv.config.video import VideoSpec
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
# Public data types (the request, :class:`VideoSpec`, is the config's video schema:
# :mod:`apbv.config.video`).


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
    bounds: dict[str, float | None] = {"min_pixels": min_pixels, "max_pixels": max_pixels}
    if spec.resized_height is not None and spec.resized_width is not None:  # set together
        height, width = spec.resized_height, spec.resized_width
        settings = f"resized_height={height}, resized_width={width}, factor {factor}"
        bounds = {"min_pixels": None, "max_pixels": None}  # smart_resize's image defaults
    elif max_pixels < min_pixels:  # unreachable: VideoSpec checks max_pixels >= min_pixels
        raise ValueError(f"{where}: max_pixels ({max_pixels}) is below min_pixels ({min_pixels})")
    try:
        out = vp.smart_resize(height, width, factor, **bounds)
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


_NO_TOTAL_CAP = 10**300
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
