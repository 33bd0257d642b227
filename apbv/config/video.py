"""The one video schema: how a video is sampled, as the config's ``[video]`` section and as one
video file's request.

:class:`VideoSettings` holds qwen-vl-utils' ``fetch_video`` keys (same names, same meaning) and
the decoder's, each with its one default and its one check. :class:`VideoConfig` (the
``[video]`` section) adds where frames are resized and the pruning settings;
:class:`VideoSpec` (one video file, re-exported by :mod:`apbv.video`) adds the path, the ViT
patch size and how the path is opened. Torch-free, like the rest of :mod:`apbv.config`: the
video stage imports this module, never the other way.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, ClassVar

from apbv.validate import boolean, integer, number, one_of, pruning_settings

VIDEO_BACKENDS = ("decord", "pyav")
"""``video.backend``: the host decoders (the CPU's, and the bit-parity reference)."""
VIDEO_DEVICE_BACKENDS = ("nvdec",)
"""``video.backend`` on the rank's GPU: ``nvdec`` is NVIDIA's hardware decoder through
torchcodec's CUDA decoder (frames stay on the device; not bit-equal to the host decoders;
written for GPU hosts and not run on a CPU machine)."""
VIDEO_DECODE_MODES = ("needed", "all")
"""``video.decode``: how PyAV walks a file; the sampled frames are the same."""
RESIZE_DEVICES = ("cpu", "cuda")
"""``video.resize_device``: where decoded frames are resized into patch rows."""
DEFAULT_FPS = 2.0
"""Frames sampled per second when neither ``fps`` nor ``nframes`` is set (qwen-vl-utils' FPS)."""
MIN_NFRAMES = 2
"""The fewest frames ``nframes`` may ask for: one temporal patch of Qwen2.5-VL's tower."""


@dataclass(frozen=True, kw_only=True)
class VideoSettings:
    """How a video is sampled: qwen-vl-utils' video keys (same names, same defaults), plus the
    decoder's. ``None`` means qwen-vl-utils' default for that key; exactly one of ``fps`` and
    ``nframes`` sets the frame count (with neither, ``fps`` is :data:`DEFAULT_FPS`).

    ValueError naming the setting (``video.KEY`` in the config, ``KEY`` in a
    :class:`VideoSpec`) and the allowed values for a bad value."""

    _prefix: ClassVar[str] = ""
    """How the errors name a setting: ``video.`` in the config, nothing in a request."""

    fps: float | None = None
    """Frames sampled per second of video (qwen-vl-utils' rule); exclusive with nframes; unset:
    2.0 (qwen-vl-utils' FPS) unless nframes is set."""
    nframes: int | None = None
    """Exact number of frames to sample (qwen-vl-utils rounds it to a multiple of 2)."""
    min_frames: int = 4
    """With fps: at least this many frames (rounded up to a multiple of 2)."""
    max_frames: int | None = None
    """With fps: at most this many frames (unset: min(768, the frames in the clip))."""
    min_pixels: int | None = None
    """Per-frame pixel floor (unset: 128 tokens = 128 * 28**2 pixels at patch 14, or max_pixels
    when that is lower; qwen-vl-utils fails there)."""
    max_pixels: int | None = None
    """Per-frame pixel cap, lowered further by total_pixels (unset: 768 * 28**2 at patch 14)."""
    total_pixels: int | None = None
    """Pixel budget of the whole video, shared by its frames (unset: qwen-vl-utils' default,
    env MODEL_SEQ_LEN (128000) * 28**2 * 0.9)."""
    video_start: float | None = None
    """Start of the clip in seconds (unset: the first frame)."""
    video_end: float | None = None
    """End of the clip in seconds (unset: the last frame)."""
    resized_height: int | None = None
    """With resized_width: every frame resized to about this size instead (rounded to multiples
    of the patch size * 2; the pixel settings are then not used), as qwen-vl-utils."""
    resized_width: int | None = None
    """With resized_height: see there."""
    backend: str = "decord"
    """Decoder: decord or pyav (chosen explicitly, never a silent fallback), or nvdec (the
    GPU's hardware decoder through torchcodec; CUDA ranks with torchcodec installed)."""
    decode: str = "needed"
    """How PyAV walks the file, the same frames bit for bit: needed (the frames nothing refers
    to are skipped unless sampled; the open checks truncation from the packet index without
    decoding the last frame; on the CPU each frame is resized as it is decoded) or all (every
    coded frame on the way, the last frame at open, chunks of stacked frames resized: the
    earlier reader, for comparisons). Both seek to the keyframe before a sampled frame unless
    the decoder is already on its way there; decord decodes the same way in both."""
    decode_threads: int | None = None
    """Decoder threads per rank (unset: the process's cores divided by the ranks, at least 1)."""
    snap_to_keyframes: float | None = None
    """Seconds (opt-in, approximate): a sampled frame within this of a keyframe takes the
    nearest keyframe instead (decoded alone; ``Sampling.moved`` lists the frames that moved);
    unset: exact sampling."""
    keyframe_split: bool = False
    """Opt-in: move each boundary of the ranks' frame split by at most one temporal patch to
    where the two ranks' frames lie in different keyframe intervals, so no two ranks walk the
    same GOP (apbv/video/gop.py; needs the file's keyframe index); the same tokens as the
    balanced split."""

    def __post_init__(self) -> None:
        p = self._prefix
        if self.fps is not None and self.nframes is not None:
            raise ValueError(f"{p}fps and {p}nframes are exclusive (got fps={self.fps!r}, "
                             f"nframes={self.nframes!r}); set one of them")
        number(f"{p}fps", self.fps, optional=True)
        integer(f"{p}nframes", self.nframes, MIN_NFRAMES, optional=True)
        if self.fps is None and self.nframes is None:
            object.__setattr__(self, "fps", DEFAULT_FPS)
        integer(f"{p}min_frames", self.min_frames, 1)
        integer(f"{p}max_frames", self.max_frames, max(MIN_NFRAMES, self.min_frames),
                optional=True)
        for name in ("min_pixels", "max_pixels", "total_pixels", "resized_height",
                     "resized_width"):
            integer(f"{p}{name}", getattr(self, name), 1, optional=True)
        if self.min_pixels is not None and self.max_pixels is not None \
                and self.max_pixels < self.min_pixels:
            raise ValueError(f"{p}max_pixels must be >= {p}min_pixels ({self.min_pixels}), "
                             f"got {self.max_pixels}")
        number(f"{p}video_start", self.video_start, low_open=False, optional=True)
        number(f"{p}video_end", self.video_end, low_open=False, optional=True)
        if self.video_start is not None and self.video_end is not None \
                and self.video_end <= self.video_start:
            raise ValueError(f"{p}video_end must be > {p}video_start ({self.video_start}), "
                             f"got {self.video_end}")
        if (self.resized_height is None) != (self.resized_width is None):
            raise ValueError(f"{p}resized_height and {p}resized_width go together; set both or "
                             f"neither (got {self.resized_height!r}, {self.resized_width!r})")
        one_of(f"{p}backend", self.backend, VIDEO_BACKENDS + VIDEO_DEVICE_BACKENDS)
        one_of(f"{p}decode", self.decode, VIDEO_DECODE_MODES)
        integer(f"{p}decode_threads", self.decode_threads, 1, optional=True)
        number(f"{p}snap_to_keyframes", self.snap_to_keyframes, optional=True)
        boolean(f"{p}keyframe_split", self.keyframe_split)

    def settings(self) -> dict[str, Any]:
        """The :class:`VideoSettings` fields by name (what a config and a request share)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(VideoSettings)}


@dataclass(frozen=True, kw_only=True)
class VideoConfig(VideoSettings):
    """Frame sampling: qwen-vl-utils' video keys (same names, same defaults), plus the decoder."""

    _prefix: ClassVar[str] = "video."

    resize_device: str = "cpu"
    """Where decoded frames are resized into patch rows: cpu (qwen-vl-utils' pixels bit for
    bit) or cuda (the rank's GPU: uint8 frames resized on the device, differing from the CPU's
    by rounding; CUDA ranks only)."""
    static_threshold: float = 0.0
    """Temporal patches changed by less, in channel levels 0-255, are dropped (0: off)."""
    pruning_rate: float = 0.0
    """Fraction of video tokens that changed least, dropped (vLLM's; 0: off; docs/pruning.md)."""

    def __post_init__(self) -> None:
        pruning_settings(self.pruning_rate, self.static_threshold)
        one_of("video.resize_device", self.resize_device, RESIZE_DEVICES)
        super().__post_init__()

    def spec(self, path: str) -> VideoSpec:
        """The sampling request for one video file (the settings carry over; where frames are
        resized is the engine's, the pruning settings are the request's)."""
        return VideoSpec(path, **self.settings())


@dataclass(frozen=True)
class VideoSpec(VideoSettings):
    """One video and how to sample it: qwen-vl-utils' ``fetch_video`` keys, plus the decoder
    (the settings are keyword-only)."""

    path: str
    """Local video file (``os.PathLike`` is accepted and stored as ``str``)."""
    image_patch_size: int = 14
    """ViT patch size; frames are resized to multiples of ``image_patch_size * 2``."""
    follow_symlinks: bool = True
    """False: open the file without following a symbolic link anywhere on ``path`` (a link is
    an error), and decode the file so opened whatever the path is swapped for meanwhile (the
    server's choice for clients' paths, checked against its media roots first)."""

    def __post_init__(self) -> None:
        path: Any = self.path
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a non-empty str or os.PathLike, got {self.path!r}")
        object.__setattr__(self, "path", path)
        super().__post_init__()
        integer("image_patch_size", self.image_patch_size, 1)
        boolean("follow_symlinks", self.follow_symlinks)

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
