"""Decode work of one video file per rank, from its keyframe structure (``plan --video``).

The file's packet index is read once (PyAV demuxes it, no frame is decoded); the sampling is
the runtime's (:func:`apbv.video.plan_sampling`); per rank, :func:`apbv.video.gop.rank_walks`
counts the coded frames walked from the keyframe before each of its samples, for the balanced
split and the keyframe-aligned one (``video.keyframe_split``). Predicted seconds: each
rank's walk and conversions (:func:`apbv.cost.predict.footage_frame_s`: every coded frame
walked at ``coded_frame_s_per_pixel``, every keyframe interval walked into at
``keyframe_s_per_pixel`` and every sampled frame's conversion at ``convert_s_per_pixel``, per
source pixel; measured on camera footage with
``video.decode=needed``, which skips the frames nothing refers to) plus the processor's work
(``process_s_per_pixel`` per resized pixel) and ``preprocess_fixed_s``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from apbv.cost.hardware import Hardware
from apbv.cost.predict import footage_frame_s
from apbv.plan import patch_ranges
from apbv.video import VideoSpec, plan_sampling, probe
from apbv.video.gop import keyframe_aligned_ranges, rank_walks, shared_intervals

if TYPE_CHECKING:
    from apbv.video.load import Planner


def footage_lines(path: str, world_size: int, hw: Hardware | None = None,
                  fps: float = 2.0, planner: Planner = plan_sampling,
                  rules: str = "qwen-vl-utils' (Qwen2.5-VL)") -> list[str]:
    """Lines describing ``path``'s decode work on ``world_size`` ranks (see the module), its
    frames chosen by ``planner`` (a model family's sampling rule, named by ``rules``: frames
    per temporal patch included, 1 for InternVL3)."""
    spec = VideoSpec(path, fps=fps, backend="pyav")
    meta = probe(spec)
    keyframes = meta.keyframes
    assert keyframes is not None  # PyAV lists them
    sampling = planner(spec, meta)
    indices, unit = sampling.indices, sampling.temporal_patch_size
    gaps = [b - a for a, b in zip(keyframes, keyframes[1:])] or [meta.total_frames]
    lines = [f"video {path}: {meta.total_frames} frames at {meta.fps:.4g} fps "
             f"({meta.duration:.1f} s), {meta.width}x{meta.height}, {len(keyframes)} "
             f"keyframes (every {sum(gaps) / len(gaps) / meta.fps:.2f} s on average); "
             f"{sampling.num_frames} frames sampled at {sampling.sample_fps:.3g} fps by "
             f"{rules} rules ({unit} per temporal patch), resized to "
             f"{sampling.resized_width}x{sampling.resized_height}"]
    splits = {"balanced": patch_ranges(sampling.num_patches, world_size),
              "keyframe-aligned": keyframe_aligned_ranges(keyframes, indices, world_size, unit)}
    pixels = meta.width * meta.height
    resized = sampling.resized_width * sampling.resized_height
    for name, ranges in splits.items():
        walks = rank_walks(keyframes, indices, ranges, unit)
        lines.append(f"{name} split {list(ranges)}: "
                     f"{shared_intervals(keyframes, indices, ranges, unit)} keyframe intervals "
                     "walked by two ranks")
        for rank, ((start, end), walk) in enumerate(zip(ranges, walks)):
            sampled = unit * (end - start)
            line = (f"  rank {rank}: {sampled} sampled frames, {walk.frames} coded "
                    f"frames walked in {walk.intervals} keyframe intervals")
            if hw is not None:
                seconds = (hw.preprocess_fixed_s + hw.video_open_s
                           + footage_frame_s(hw, walk.frames, sampled, pixels, walk.intervals)
                           + sampled * hw.process_s_per_pixel * resized)
                line += f", predicted frame work {seconds:.2f} s on {hw.name}"
            lines.append(line)
    return lines
