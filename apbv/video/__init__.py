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

   Where qwen-vl-utils fails we raise a ValueError naming the video, its size and the settings
   (an aspect ratio over 200, a side that would be resized to 0 pixels), with one extension: a
   ``max_pixels`` below the default ``min_pixels`` (128 * 28**2, min_pixels not given) lowers
   that floor to ``max_pixels`` instead of failing smart_resize's assertion, so the cap wins.

3. Frame parallelism: a temporal patch is 2 consecutive sampled frames (Qwen2.5-VL's ViT never
   attends across them). :func:`apbv.plan.patch_ranges` splits the T patches into H contiguous,
   near-equal ranges (earlier ranks get the extra ones) and :func:`load_rank_frames` decodes and
   resizes only the frames of one range. The resize target comes from the global sampling, so
   concatenating every rank's frames in rank order equals :func:`load_all_frames`.

Frames are resized exactly as qwen-vl-utils' ``fetch_video`` does (torchvision bicubic with
antialias on the uint8 frames) and returned as uint8; ``.float()`` gives its tensor bit for bit.

Decoders: decord (default) or PyAV (``backend="pyav"``), chosen explicitly and never swapped for
one another, but for the files whose frames decord cannot copy out at all (some small frame
widths, 16x16 among them: a decord limitation), which PyAV reads. qwen-vl-utils' own reader
selection (torchcodec first, then a silent fallback to torchvision's ``read_video``, which
torchvision 0.29 removed) is never used. decord, PyAV, qwen-vl-utils and torchvision (the
``video`` extra) are imported only when needed, so ``import apbv.video`` works without them.

Layout: :mod:`apbv.video.sampling` (the sampling types and the pure sampling rules; the
request, :class:`VideoSpec`, is the config's video schema in :mod:`apbv.config.video`),
:mod:`apbv.video.frames` (decoded frames' types), :mod:`apbv.video.decoders` (decord and PyAV
readers with their file checks) and :mod:`apbv.video.load` (probe and frame-parallel loading).
The public names are re-exported here.
"""

from apbv.config.video import VIDEO_BACKENDS as BACKENDS
from apbv.config.video import VIDEO_DECODE_MODES as DECODE_MODES
from apbv.config.video import VIDEO_DEVICE_BACKENDS as DEVICE_BACKENDS
from apbv.video.frames import DecodedVideo, RankFrames
from apbv.video.load import (
    VideoIdentity,
    decoded_rank_frames,
    load_all_frames,
    load_rank_frames,
    probe,
    video_identity,
)
from apbv.video.sampling import (
    TEMPORAL_PATCH_SIZE,
    Sampling,
    VideoMeta,
    VideoSpec,
    plan_sampling,
)

__all__ = [
    "BACKENDS", "DECODE_MODES", "DEVICE_BACKENDS",
    "TEMPORAL_PATCH_SIZE", "DecodedVideo", "RankFrames", "Sampling",
    "VideoIdentity", "VideoMeta", "decoded_rank_frames",
    "VideoSpec", "load_all_frames", "load_rank_frames", "plan_sampling", "probe",
    "video_identity",
]
