"""Video ingestion: sample the frames of one video, then decode and resize only this rank's share.

The stage has three steps, each usable on its own:

1. :func:`probe` opens the file with the chosen decoder and returns its :class:`VideoMeta`
   (frame count, native fps, size). It also checks the file: missing, unreadable, corrupt,
   truncated (the last listed frame must decode) or empty files raise ``ValueError`` naming the
   file. The checks depend only on the file, so every rank raises the same error.
2. :func:`plan_sampling` is a pure function of (:class:`VideoSpec`, :class:`VideoMeta`): the frame
   indices, the sample fps and the resize target, by qwen-vl-utils' rules (the Qwen2.5-VL
   reference preprocessing). Its own functions ``calculate_video_frame_range``, ``smart_nframes``,
   ``smart_resize`` and constants are called; the two rules that live inline in its readers are
   ported here and checked against it in the tests:

   - indices = ``torch.linspace(start, end, n).round()`` over the (clipped) frame range, and
     sample fps = n / (frames in the range) * native fps;
   - per-frame pixel cap = max(min(768 * 28**2, total_pixels / n * 2), int(1.05 * min_pixels)),
     lowered further by ``max_pixels`` when given (28 = patch 14 * spatial merge 2).

3. Frame parallelism: a temporal patch is 2 consecutive sampled frames (Qwen2.5-VL's ViT never
   attends across them). :func:`apbv.plan.patch_ranges` splits the T patches into H contiguous,
   near-equal ranges (earlier ranks get the extra ones) and :func:`load_rank_frames` decodes and
   resizes only the frames of one range. The resize target comes from the global sampling, so
   concatenating every rank's frames in rank order equals :func:`load_all_frames`.

Frames are resized exactly as qwen-vl-utils' ``fetch_video`` does (torchvision bicubic with
antialias on the uint8 frames) and returned as uint8; ``.float()`` gives its tensor bit for bit.

Decoders: decord (default) or PyAV (``backend="pyav"``), chosen explicitly and never swapped for
one another. qwen-vl-utils' own reader selection (torchcodec first, then a silent fallback to
torchvision's ``read_video``, which torchvision 0.29 removed) is never used. decord, PyAV,
qwen-vl-utils and torchvision (the ``video`` extra) are imported only when needed, so
``import apbv.video`` works without them.
"""

from __future__ import annotations

import bisect
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from apbv.plan import Range, check_int, patch_ranges

BACKENDS = ("decord", "pyav")
"""The decoders :class:`VideoSpec` accepts."""

TEMPORAL_PATCH_SIZE = 2
"""Frames per temporal patch of Qwen2.5-VL's vision tower (qwen-vl-utils' FRAME_FACTOR)."""

_EXTRA = "install the video extra: pip install 'apbv[video]'"
_CHUNK_ELEMENTS = 1 << 25  # decode + resize at most ~32 Mi uint8 values (one float copy) at once

# ---------------------------------------------------------------------------------------------
# Lazy imports of the optional `video` extra.


def _import(module: str, package: str, purpose: str) -> ModuleType:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"{purpose} needs the package {package!r}; {_EXTRA}") from err


def _qwen() -> ModuleType:
    """qwen_vl_utils.vision_process (the reference sampling rules)."""
    return _import("qwen_vl_utils.vision_process", "qwen-vl-utils", "frame sampling")


def _resize_fn() -> Any:
    """torchvision's tensor resize and its bicubic mode, as qwen-vl-utils calls them."""
    functional = _import("torchvision.transforms.functional", "torchvision", "frame resizing")
    return functional.resize, functional.InterpolationMode.BICUBIC


# ---------------------------------------------------------------------------------------------
# Value checks.


def _check_number(name: str, value: object, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return float(value)


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
    """Per-frame pixel floor; None: 128 tokens = 128 * 28**2 pixels (patch 14)."""
    max_pixels: int | None = None
    """Per-frame pixel cap, lowered further by total_pixels; None: 768 * 28**2 (patch 14)."""
    total_pixels: float | None = None
    """Pixel budget of the whole video; None: env MODEL_SEQ_LEN (128000) * 28**2 * 0.9."""
    video_start: float | None = None
    """Start of the clip in seconds (None: the first frame)."""
    video_end: float | None = None
    """End of the clip in seconds (None: the last frame)."""
    backend: str = "decord"
    """Decoder: one of :data:`BACKENDS`. There is no fallback from one to the other."""
    image_patch_size: int = 14
    """ViT patch size; frames are resized to multiples of ``image_patch_size * 2``."""

    def __post_init__(self) -> None:
        path = self.path
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a non-empty str or os.PathLike, got {self.path!r}")
        object.__setattr__(self, "path", path)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.fps is not None and self.nframes is not None:
            raise ValueError(
                f"fps and nframes are mutually exclusive (got fps={self.fps!r}, "
                f"nframes={self.nframes!r}); give one of them"
            )
        if self.fps is not None:
            _check_number("fps", self.fps, positive=True)
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
            _check_number("total_pixels", self.total_pixels, positive=True)
        if self.video_start is not None:
            _check_number("video_start", self.video_start, positive=False)
        if self.video_end is not None:
            _check_number("video_end", self.video_end, positive=False)
            if self.video_start is not None and self.video_end <= self.video_start:
                raise ValueError(
                    f"video_end ({self.video_end}) must be > video_start ({self.video_start})"
                )
        check_int("image_patch_size", self.image_patch_size, 1)

    def qwen_element(self) -> dict[str, Any]:
        """The equivalent qwen-vl-utils video element (only the keys that are set)."""
        ele: dict[str, Any] = {"video": self.path}
        for key in ("fps", "nframes", "max_frames", "min_pixels", "max_pixels", "total_pixels",
                    "video_start", "video_end"):
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

    def __post_init__(self) -> None:
        check_int("total_frames", self.total_frames, 1)
        _check_number("fps", self.fps, positive=True)
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

    def __post_init__(self) -> None:
        assert len(self.indices) % TEMPORAL_PATCH_SIZE == 0 and self.indices, self.indices

    @property
    def num_frames(self) -> int:
        return len(self.indices)

    @property
    def num_patches(self) -> int:
        """T: temporal patches (pairs of consecutive sampled frames)."""
        return len(self.indices) // TEMPORAL_PATCH_SIZE

    @property
    def second_per_grid_t(self) -> float:
        """Seconds per temporal patch, temporal_patch_size / sample_fps (M-RoPE time step)."""
        return TEMPORAL_PATCH_SIZE / self.sample_fps

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        """(T, height / patch, width / patch): the processor's ``video_grid_thw`` row."""
        p = self.image_patch_size
        return self.num_patches, self.resized_height // p, self.resized_width // p


@dataclass(frozen=True)
class RankFrames:
    """One rank's share of a video: its frames, already resized, and the global sampling."""

    frames: torch.Tensor
    """uint8 (t_local, 3, resized_height, resized_width), RGB, t_local = 2 * patches here."""
    patch_range: Range
    """[start, end) of this rank's temporal patches among the video's T patches."""
    sampling: Sampling
    """The global sampling (identical on every rank)."""
    rank: int
    world_size: int

    @property
    def frame_range(self) -> Range:
        """[start, end) of this rank's frames among the sampled frames."""
        start, end = self.patch_range
        return TEMPORAL_PATCH_SIZE * start, TEMPORAL_PATCH_SIZE * end

    @property
    def indices(self) -> tuple[int, ...]:
        """File frame indices of this rank's frames."""
        start, end = self.frame_range
        return self.sampling.indices[start:end]


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
    return Sampling(tuple(indices), sample_fps, height, width, spec.image_patch_size)


def _resize_target(
    vp: ModuleType, spec: VideoSpec, height: int, width: int, nframes: int, where: str
) -> tuple[int, int]:
    """qwen-vl-utils' fetch_video size rule for nframes frames of height x width."""
    factor = spec.image_patch_size * vp.SPATIAL_MERGE_SIZE
    frame_min = vp.VIDEO_MIN_TOKEN_NUM * factor * factor
    frame_max = vp.VIDEO_MAX_TOKEN_NUM * factor * factor
    min_pixels = spec.min_pixels if spec.min_pixels is not None else frame_min
    total_pixels = spec.total_pixels
    if total_pixels is None:
        total_pixels = vp.MODEL_SEQ_LEN * factor * factor * 0.9
    cap = total_pixels / nframes * vp.FRAME_FACTOR  # the video's budget shared by its frames
    max_pixels = max(min(frame_max, cap), int(min_pixels * 1.05))
    if spec.max_pixels is not None:
        max_pixels = min(spec.max_pixels, max_pixels)
    if max_pixels < min_pixels:
        raise ValueError(f"{where}: max_pixels ({max_pixels}) is below min_pixels ({min_pixels})")
    try:
        return vp.smart_resize(height, width, factor, min_pixels=min_pixels, max_pixels=max_pixels)
    except ValueError as err:  # aspect ratio beyond qwen-vl-utils' MAX_RATIO
        raise ValueError(f"{where}: frames of {width}x{height} cannot be resized: {err}") from err


# ---------------------------------------------------------------------------------------------
# Decoders. Each opens and checks the file in its constructor, then reads frames by index.


def _decoder_message(err: BaseException) -> str:
    """The decoder's error text without its log timestamps ("[20:39:54] "), so every rank
    that hits the same error reports the same message."""
    return re.sub(r"\[\d{2}:\d{2}:\d{2}\] ", "", f"{type(err).__name__}: {err}")


def _unreadable(path: str, backend: str, err: BaseException) -> ValueError:
    return ValueError(
        f"video {path!r} cannot be read by {backend} (not a video file, an empty video, or "
        f"corrupt or truncated): {_decoder_message(err)}"
    )


def _truncated(path: str, detail: str) -> ValueError:
    return ValueError(f"video {path!r} is truncated or corrupt: {detail}")


class _Reader:
    """Base of the decoders: ``meta`` after construction, ``read(indices)`` -> (k, H, W, 3)."""

    path: str
    meta: VideoMeta

    def read(self, indices: Sequence[int]) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def _make_meta(self, total_frames: int, fps: float, last_frame: Any) -> VideoMeta:
        if not (isinstance(fps, (int, float)) and math.isfinite(fps) and fps > 0):
            raise ValueError(f"video {self.path!r} reports an invalid frame rate {fps!r}")
        height, width = int(last_frame.shape[0]), int(last_frame.shape[1])
        return VideoMeta(total_frames, float(fps), height, width)


class _DecordReader(_Reader):
    def __init__(self, path: str) -> None:
        decord = _import("decord", "decord", "backend='decord'")
        self.path = path
        try:
            self._vr = decord.VideoReader(path)
            total = len(self._vr)
            fps = self._vr.get_avg_fps()
        except Exception as err:  # decord raises DECORDError/RuntimeError with C++ messages
            raise _unreadable(path, "decord", err) from err
        if total < 1:
            raise ValueError(f"video {path!r} has no video frames")
        try:  # the last listed frame must decode, or a truncated tail fails on some rank only
            last = self._to_numpy(self._vr.get_batch([total - 1]))[0]
        except Exception as err:
            raise _truncated(
                path, f"its index lists {total} frames but the last one cannot be decoded "
                f"({_decoder_message(err)})"
            ) from err
        self.meta = self._make_meta(total, fps, last)

    @staticmethod
    def _to_numpy(batch: Any) -> Any:
        # decord.bridge may have been set to torch/tensorflow elsewhere in the process.
        return batch.asnumpy() if hasattr(batch, "asnumpy") else batch

    def read(self, indices: Sequence[int]) -> torch.Tensor:
        try:
            batch = self._to_numpy(self._vr.get_batch(list(indices)))
        except Exception as err:
            raise _truncated(self.path, f"decoding frames {indices[0]}..{indices[-1]} failed "
                             f"({_decoder_message(err)})") from err
        return torch.as_tensor(batch)

    def close(self) -> None:
        self._vr = None


class _PyAVReader(_Reader):
    """Frame-accurate random access: frame i is the packet with the i-th smallest pts (as in
    decord); decoding seeks to the keyframe before a target unless it is already on the way."""

    def __init__(self, path: str) -> None:
        av = _import("av", "av", "backend='pyav'")
        self.path = path
        self._av = av
        try:
            self._container = av.open(path)
        except Exception as err:
            raise _unreadable(path, "pyav", err) from err
        try:
            self._init(av)
        except BaseException:
            self.close()
            raise

    def _init(self, av: ModuleType) -> None:
        path = self.path
        try:
            stream = self._container.streams.best("video")
        except Exception as err:
            raise _unreadable(path, "pyav", err) from err
        if stream is None:
            raise ValueError(f"video {path!r} has no video stream")
        stream.thread_type = "AUTO"
        self._stream = stream
        pts: list[int] = []
        keys: list[int] = []
        try:
            for packet in self._container.demux(stream):
                if packet.size == 0 and packet.pts is None:
                    continue  # the demuxer's flush packet
                if packet.is_corrupt:
                    raise _truncated(path, f"the packet of frame {len(pts)} is incomplete")
                if packet.pts is None:
                    raise ValueError(
                        f"video {path!r} has packets without timestamps; use backend='decord'"
                    )
                pts.append(packet.pts)
                if packet.is_keyframe:
                    keys.append(packet.pts)
        except av.FFmpegError as err:
            raise _truncated(path, f"demuxing stopped after {len(pts)} frames ({err})") from err
        if not pts:
            raise ValueError(f"video {path!r} has no video frames")
        if stream.frames > len(pts):
            raise _truncated(
                path, f"its index lists {stream.frames} frames but only {len(pts)} can be read"
            )
        self._pts = sorted(pts)
        self._keys = sorted(keys)
        self._decoder: Iterator[Any] | None = None
        self._last_pts: int | None = None
        self._last_pos: int | None = None
        self._last_array: Any = None
        rate = stream.average_rate
        fps = float(rate) if rate else float("nan")
        last = self._frame(len(pts) - 1)
        self.meta = self._make_meta(len(pts), fps, last)

    def _frame(self, pos: int) -> Any:
        """Frame ``pos`` as a (H, W, 3) uint8 numpy array."""
        if pos == self._last_pos:
            return self._last_array
        target = self._pts[pos]
        k = bisect.bisect_right(self._keys, target) - 1
        key = self._keys[k] if k >= 0 else self._pts[0]
        last = self._last_pts
        try:
            if self._decoder is None or last is None or last >= target or key > last:
                self._container.seek(key, backward=True, any_frame=False, stream=self._stream)
                self._decoder = self._container.decode(self._stream)
                self._last_pts = None
            for frame in self._decoder:
                if frame.pts is None:
                    raise ValueError(f"video {self.path!r} decodes frames without timestamps; "
                                     "use backend='decord'")
                self._last_pts = frame.pts
                if frame.pts == target:
                    self._last_pos = pos
                    self._last_array = frame.to_ndarray(format="rgb24")
                    return self._last_array
                if frame.pts > target:
                    break
        except self._av.FFmpegError as err:
            self._decoder = None
            raise _truncated(self.path, f"decoding frame {pos} of {len(self._pts)} failed "
                             f"({err})") from err
        self._decoder = None
        raise _truncated(self.path, f"frame {pos} of {len(self._pts)} (pts {target}) is listed "
                         "in the index but the decoder does not produce it")

    def read(self, indices: Sequence[int]) -> torch.Tensor:
        import numpy as np

        return torch.as_tensor(np.stack([self._frame(i) for i in indices]))

    def close(self) -> None:
        container = getattr(self, "_container", None)
        if container is not None:
            container.close()
            self._container = None


def _check_file(path: str) -> None:
    if not os.path.exists(path):
        raise ValueError(f"video file {path!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"video path {path!r} is not a regular file")


def _open(spec: VideoSpec) -> _Reader:
    _check_file(spec.path)
    if spec.backend == "decord":
        return _DecordReader(spec.path)
    assert spec.backend == "pyav", spec.backend
    return _PyAVReader(spec.path)


# ---------------------------------------------------------------------------------------------
# Public loading API.


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
    resize, bicubic = _resize_fn()
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
        resized = resize(frames, [height, width], interpolation=bicubic, antialias=True)
        out[start:start + len(resized)] = resized
    return out


def load_rank_frames(spec: VideoSpec, rank: int, world_size: int) -> RankFrames:
    """Decode and resize only the frames of ``rank``'s temporal patches (frame parallelism).

    Every rank probes the file and plans the sampling itself (same file, same result), so the
    resize target is the global one and the ranks' frames, concatenated in rank order, equal
    :func:`load_all_frames`. Errors are raised before any decoding and are the same on every
    rank: see :func:`probe`, :func:`plan_sampling`, and fewer temporal patches than ranks.
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
        first, last = (TEMPORAL_PATCH_SIZE * p for p in patches)
        frames = _decode_resized(reader, sampling.indices[first:last], sampling)
    finally:
        reader.close()
    return RankFrames(frames, patches, sampling, rank, world_size)


def load_all_frames(spec: VideoSpec) -> RankFrames:
    """The whole sampled video in one process: :func:`load_rank_frames` with rank 0 of 1.

    ``result.frames.float()`` equals qwen-vl-utils' ``fetch_video`` tensor (T*2, 3, H', W').
    """
    return load_rank_frames(spec, 0, 1)
