"""The frames a rank holds once decoded: a request's own decoded pixels (:class:`DecodedVideo`)
and one rank's share of a sampled video (:class:`RankFrames`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from apbv.plan import Range
from apbv.validate import positive
from apbv.video.sampling import TEMPORAL_PATCH_SIZE, Sampling, VideoSpec


@dataclass(frozen=True, eq=False)
class DecodedVideo:
    """Frames already decoded and resized, with their rate: a one-shot request on exactly
    these pixels (e.g. a stream's frames, to compare a stream's answer with one-shot)."""

    frames: torch.Tensor
    """uint8 (F, 3, H, W), RGB; F a positive multiple of 2 (temporal patches), H and W
    multiples of ``image_patch_size * 2``."""
    fps: float
    """Frames per second of ``frames`` (the M-RoPE time step is 2 / fps seconds per patch)."""
    image_patch_size: int = 14

    def __post_init__(self) -> None:
        frames, factor = self.frames, self.image_patch_size * 2
        if not isinstance(frames, torch.Tensor) or frames.dtype != torch.uint8 \
                or frames.dim() != 4 or frames.shape[1] != 3:
            got = (f"{frames.dtype} {tuple(frames.shape)}" if isinstance(frames, torch.Tensor)
                   else type(frames).__name__)
            raise ValueError(f"decoded frames must be a uint8 tensor (F, 3, H, W), got {got}")
        n, _, height, width = frames.shape
        if n == 0 or n % TEMPORAL_PATCH_SIZE:
            raise ValueError(f"decoded frames: {n} frames; the count must be a positive "
                             f"multiple of {TEMPORAL_PATCH_SIZE} (whole temporal patches)")
        if height % factor or width % factor:
            raise ValueError(f"decoded frames of {width}x{height}: both sides must be "
                             f"multiples of {factor}")
        object.__setattr__(self, "fps", positive("fps", self.fps))

    @property
    def sampling(self) -> Sampling:
        """Every frame, at ``fps``, at its own size (frame i at i / ``fps`` seconds, for a
        family that writes times into its prompt: ``video_fps``)."""
        n, _, height, width = self.frames.shape
        return Sampling(tuple(range(n)), self.fps, height, width, self.image_patch_size,
                        video_fps=self.fps)

    def identity(self) -> str:
        """Shape, rate and a digest of the pixels: equal on ranks holding the same frames."""
        import hashlib

        digest = hashlib.sha256(self.frames.contiguous().numpy().tobytes()).hexdigest()[:16]
        return f"{tuple(self.frames.shape)} at {self.fps:g} fps, sha256 {digest}"


def frames_size(height: int, width: int, count: int, spec: VideoSpec) -> tuple[int, int]:
    """(h, w) that ``count`` frames of ``height`` x ``width`` given already decoded (a chat
    request's images) are resized to: Qwen2.5-VL's one-shot rule for a video of ``count``
    sampled frames (qwen-vl-utils' fetch_video size with ``spec``'s pixel bounds, its
    ``total_pixels`` shared by the frames, sides multiples of ``spec.image_patch_size * 2``);
    ValueError naming the frames when they cannot be resized."""
    from apbv.video.sampling import _qwen, _resize_target

    return _resize_target(_qwen(), spec, height, width, count, "the image frames")


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
        unit = self.sampling.temporal_patch_size
        return unit * start, unit * end

    @property
    def indices(self) -> tuple[int, ...]:
        """File frame indices of this rank's frames."""
        start, end = self.frame_range
        return self.sampling.indices[start:end]
