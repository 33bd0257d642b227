"""The decoders: decord and PyAV readers that open and check a file, then read frames by index.

Errors name the file and are the same on every rank (they depend only on the file).
"""

from __future__ import annotations

import bisect
import math
import os
import re
from collections.abc import Iterator, Sequence
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from apbv.config.video import VIDEO_BACKENDS as BACKENDS
from apbv.video.nofollow import fd_path, open_nofollow
from apbv.video.sampling import VideoMeta, VideoSpec, _import


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


DECORD_COPY_ERROR = "DECORDArrayCopyFromTo"
"""In decord's error when it cannot copy a decoded frame of a valid file out of its padded
buffer (some frame widths, 16x16 among them; measured with decord 0.6)."""


class DecordFrameSizeError(ValueError):
    """decord cannot read a valid file's frames (:data:`DECORD_COPY_ERROR`); PyAV can."""


class _Reader:
    """Base of the decoders: ``meta`` after construction, ``read(indices)`` -> (k, H, W, 3)."""

    path: str
    meta: VideoMeta
    per_frame = False
    """Resize each frame as it is decoded (``video.decode=needed`` on the CPU) instead of a
    chunk of stacked frames (the earlier conversion, kept with ``video.decode=all``)."""

    def expect(self, indices: Sequence[int]) -> None:
        """Announce every frame the coming :meth:`read` calls ask for (ascending), so a
        decoder that skips frames keeps those it will be asked for later."""

    def read(self, indices: Sequence[int]) -> torch.Tensor:
        raise NotImplementedError

    def frames(self, indices: Sequence[int]) -> Iterator[torch.Tensor]:
        """The frames of ``indices`` one at a time, uint8 (H, W, 3) each (views of one
        :meth:`read` here; the PyAV reader decodes each as it is asked for)."""
        yield from self.read(indices)

    def close(self) -> None:
        pass

    def _make_meta(self, total_frames: int, fps: float, last_frame: Any,
                   keyframes: Sequence[int] | None = None) -> VideoMeta:
        if not (isinstance(fps, (int, float)) and math.isfinite(fps) and fps > 0):
            raise ValueError(f"video {self.path!r} reports an invalid frame rate {fps!r}")
        height, width = int(last_frame.shape[0]), int(last_frame.shape[1])
        keys = None if keyframes is None else tuple(int(k) for k in keyframes)
        return VideoMeta(total_frames, float(fps), height, width, keys)


class _DecordReader(_Reader):
    def __init__(self, path: str, source: str, threads: int = 0) -> None:
        decord = _import("decord", "decord", "backend='decord'")
        self.path = path
        try:
            self._vr = decord.VideoReader(source, num_threads=threads)
            total = len(self._vr)
            fps = self._vr.get_avg_fps()
        except Exception as err:  # decord raises DECORDError/RuntimeError with C++ messages
            raise _unreadable(path, "decord", err) from err
        if total < 1:
            raise ValueError(f"video {path!r} has no video frames")
        try:  # the last listed frame must decode, or a truncated tail fails on some rank only
            last = self._to_numpy(self._vr.get_batch([total - 1]))[0]
        except Exception as err:
            if DECORD_COPY_ERROR in str(err):
                raise DecordFrameSizeError(
                    f"decord cannot read the frames of video {path!r}: its frame copy fails "
                    f"on some small frame widths (16 or 24 pixels, for example; a decord "
                    f"limitation, not a corrupt file: {_decoder_message(err)})") from err
            raise _truncated(
                path, f"its index lists {total} frames but the last one cannot be decoded "
                f"({_decoder_message(err)})"
            ) from err
        self.meta = self._make_meta(total, fps, last, self._vr.get_key_indices())

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
    decord); decoding seeks to the keyframe before a target unless it is already on the way.

    ``needed`` (:attr:`VideoSpec.decode`): packets whose frame is not expected (:meth:`expect`)
    are decoded with ``skip_frame=NONREF``: the decoder drops them when no other frame refers
    to them, which leaves every other frame bit for bit as it was; and the open reads the size
    from the stream instead of decoding the last frame. ``threads``: the decoder's thread
    count (0: FFmpeg's choice)."""

    def __init__(self, path: str, source: str, needed: bool = True, threads: int = 0) -> None:
        av = _import("av", "av", "backend='pyav'")
        self.path = path
        self._av = av
        self._needed = needed
        self._threads = threads
        try:
            self._container = av.open(source)
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
        stream.codec_context.thread_count = self._threads
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
        self.frames_decoded = 0
        """Frames the decoder produced so far (the work: skipped frames are not counted)."""
        self._wanted: set[int] = set()
        rate = stream.average_rate
        fps = float(rate) if rate else float("nan")
        if self._needed:  # every packet is complete (checked above): no decode at the end
            context = stream.codec_context
            size = SimpleNamespace(shape=(context.height, context.width))
            self.meta = self._make_meta(len(pts), fps, size, self.keyframes)
        else:
            self.meta = self._make_meta(len(pts), fps, self._frame(len(pts) - 1),
                                        self.keyframes)

    @property
    def keyframes(self) -> tuple[int, ...]:
        """Frame indices (into the sorted pts) of the keyframes, ascending."""
        return tuple(bisect.bisect_left(self._pts, key) for key in self._keys)

    def expect(self, indices: Sequence[int]) -> None:
        self._wanted.update(self._pts[i] for i in indices)

    def _decode(self) -> Iterator[Any]:
        """Frames from the current position on, counted in :attr:`frames_decoded`. needed:
        the packets of unexpected frames are decoded with ``skip_frame=NONREF`` (dropped
        when nothing refers to them), the expected ones in full."""
        context = self._stream.codec_context
        if not self._needed:
            for frame in self._container.decode(self._stream):
                self.frames_decoded += 1
                yield frame
            return
        for packet in self._container.demux(self._stream):
            context.skip_frame = "DEFAULT" if packet.pts in self._wanted else "NONREF"
            for frame in context.decode(packet):
                self.frames_decoded += 1
                yield frame

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
                self._decoder = self._decode()
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

        self.expect(indices)
        return torch.as_tensor(np.stack([self._frame(i) for i in indices]))

    def frames(self, indices: Sequence[int]) -> Iterator[torch.Tensor]:
        self.expect(indices)
        for i in indices:
            yield torch.from_numpy(self._frame(i))

    def close(self) -> None:
        container = getattr(self, "_container", None)
        if container is not None:
            container.close()
            self._container = None


class _NvdecReader(_Reader):
    """NVIDIA's hardware decoder through torchcodec's CUDA decoder (``backend="nvdec"``):
    frames are decoded on ``device`` and stay there (uint8 (k, H, W, 3) views of its
    (k, 3, H, W) batches). Frame i is the i-th frame in presentation order (torchcodec's exact
    seek mode, as decord and PyAV). The truncation check decodes the last frame, as the host
    decoders' earlier check did. Not bit-equal to the host decoders (the colour conversion
    differs); written for GPU hosts, not run on a CPU machine."""

    def __init__(self, path: str, source: str) -> None:
        try:
            from torchcodec.decoders import VideoDecoder
        except Exception as err:  # ImportError, or its FFmpeg/CUDA libraries failing to load
            raise ValueError(
                f"backend='nvdec' needs torchcodec with CUDA support and the host's FFmpeg and "
                f"CUDA libraries (allowed backends without them: {', '.join(BACKENDS)}): "
                f"{_decoder_message(err)}") from err
        if not torch.cuda.is_available():
            raise ValueError("backend='nvdec' needs a CUDA device; this process sees none "
                             f"(use one of {', '.join(BACKENDS)})")
        self.path = path
        try:
            device = f"cuda:{torch.cuda.current_device()}"  # the rank's own GPU
            self._decoder = VideoDecoder(source, device=device, seek_mode="exact")
            info = self._decoder.metadata
            total, fps = int(info.num_frames or 0), info.average_fps
        except Exception as err:
            raise _unreadable(path, "nvdec", err) from err
        if total < 1:
            raise ValueError(f"video {path!r} has no video frames")
        try:
            last = self.read([total - 1])[0]
        except ValueError as err:
            raise _truncated(path, f"its index lists {total} frames but the last one cannot "
                             f"be decoded ({err})") from err
        self.meta = self._make_meta(total, float(fps or float("nan")), last)

    def read(self, indices: Sequence[int]) -> torch.Tensor:
        try:
            batch = self._decoder.get_frames_at(indices=list(indices)).data
        except Exception as err:
            raise _truncated(self.path, f"decoding frames {indices[0]}..{indices[-1]} failed "
                             f"({_decoder_message(err)})") from err
        return batch.permute(0, 2, 3, 1)

    def close(self) -> None:
        self._decoder = None


def _check_file(path: str) -> None:
    if not os.path.exists(path):
        raise ValueError(f"video file {path!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"video path {path!r} is not a regular file")


def decode_threads(spec: VideoSpec, world_size: int = 1) -> int:
    """``spec.decode_threads``, else this process's cores shared by ``world_size`` ranks
    (at least 1)."""
    if spec.decode_threads is not None:
        return spec.decode_threads
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


def _open(spec: VideoSpec, world_size: int = 1) -> _Reader:
    """The decoder of ``spec.path`` (:func:`_reader`); with ``spec.follow_symlinks`` off, of
    the file the path names without a link anywhere on it (:func:`open_nofollow`), opened once
    here: the decoder reads that file whatever the path is swapped for meanwhile."""
    if spec.follow_symlinks:
        _check_file(spec.path)
        return _reader(spec, spec.path, world_size)
    fd = open_nofollow(spec.path, "video file")
    try:  # the decoder opens the descriptor's file again and keeps it open
        return _reader(spec, fd_path(fd), world_size)
    finally:
        os.close(fd)


def _reader(spec: VideoSpec, source: str, world_size: int = 1) -> _Reader:
    """``spec.backend``'s reader of ``source`` (threads: :func:`decode_threads`); a file whose
    frames decord cannot copy out (:class:`DecordFrameSizeError`, a property of the file: the
    same on every rank) is read by PyAV, or refused saying so when PyAV is not installed."""
    threads = decode_threads(spec, world_size)
    needed = spec.decode == "needed"
    if spec.backend == "nvdec":
        return _NvdecReader(spec.path, source)
    reader: _Reader
    if spec.backend == "pyav":
        reader = _PyAVReader(spec.path, source, needed, threads)
    else:
        try:
            reader = _DecordReader(spec.path, source, threads)
        except DecordFrameSizeError as err:
            try:
                reader = _PyAVReader(spec.path, source, needed, threads)
            except ImportError:
                raise ValueError(f"{err}; PyAV reads it but is not installed (the 'video' "
                                 "extra)") from err
    reader.per_frame = needed
    return reader
