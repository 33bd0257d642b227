"""Frames sent as images: the ``image_url`` parts of a chat request's user message read as one
video of decoded frames (:class:`apbv.video.DecodedVideo`), and the size limit of its ``data:``
URLs.

lmms-eval's ``openai_compatible`` model and most clients that extract frames themselves send a
video this way: one user message with a text part and N ``{"type": "image_url", "image_url":
{"url": "data:image/png;base64,..."}}`` parts, the frames in time order. Each part is one
frame: a ``data:image/png`` or ``data:image/jpeg`` base64 URL, or a ``file://`` PNG or JPEG
under a media root (http(s) image URLs are refused: send the bytes inline). Every frame must
have frame 0's size and at most ``--max-push-frame-pixels`` pixels (read from its header
before it is decoded). The frames are resized to one size by the one-shot path's rule for a
video of that many frames (:func:`apbv.video.frames.frames_size`; the request's ``max_pixels``
applies) and taken at the request's ``fps`` (or ``mm_processor_kwargs.fps``), else at
:data:`DEFAULT_FPS`: frame i at i / fps seconds. An odd count is padded with a copy of the
last frame (whole temporal patches of two frames, as the family's processor does with one
image), so a single image is a one-frame video.
"""

from __future__ import annotations

import base64
import binascii
import functools
import math
import os

import torch

from apbv.openai.frames import decode_image
from apbv.openai.policy import ClientError, Limits, MediaPolicy, resolve_media
from apbv.video import TEMPORAL_PATCH_SIZE, DecodedVideo, VideoSpec

DEFAULT_FPS = 2.0
"""Frames per second of frames sent as images when the request gives no ``fps``: the rate
at which the one-shot path samples a video file by default (qwen-vl-utils' 2 fps), so a
temporal patch of two frames spans one second."""
IMAGE_TYPES = ("image/jpeg", "image/jpg", "image/png")
"""The ``data:`` media types taken for a frame (the bytes must be a PNG or JPEG image)."""


def data_size(urls: list[str], limits: Limits) -> int:
    """Bytes of the ``data:`` URLs among ``urls`` together (their base64 text), or
    ClientError 413 naming the total and ``--max-data-bytes`` in MiB."""
    total = sum(len(url) for url in urls if url[:5].lower() == "data:")
    limits.check("data", total, limits.max_data_bytes, "max-data-bytes",
                 f"the request's {sum(u[:5].lower() == 'data:' for u in urls)} data: URL(s) "
                 "together")
    return total


def image_video(urls: list[str], spec: VideoSpec, fps: float | None, limits: Limits,
                policy: MediaPolicy) -> DecodedVideo:
    """The video of the frames sent as the image URLs ``urls`` (in order; the count checked
    against ``--max-frames`` before any is decoded), sized by ``spec``'s pixel bounds and
    patch size, at ``fps`` (None: :data:`DEFAULT_FPS`); ClientError naming the part at fault."""
    from apbv.openai.frames import resize_to
    from apbv.video.frames import frames_size

    if fps is None:
        fps = DEFAULT_FPS
    if not math.isfinite(fps) or fps <= 0:
        raise ClientError(400, f"fps must be > 0 for frames sent as images, got {fps!r}",
                          param="fps")
    count = len(urls) + len(urls) % TEMPORAL_PATCH_SIZE
    limits.check("frames", count, limits.max_frames, "max-frames",
                 "the number of frames sent as images (an odd count padded by one)")
    images = [_read(i, url, limits, policy) for i, url in enumerate(urls)]
    height, width = images[0].shape[:2]
    for i, image in enumerate(images):
        if tuple(image.shape[:2]) != (height, width):
            raise ClientError(400, f"image {i} is {image.shape[1]}x{image.shape[0]}, but image "
                                   f"0 is {width}x{height}: frames sent as images of one video "
                                   "must have one size")
    try:
        size = frames_size(height, width, count, spec)
    except ValueError as exc:
        raise ClientError(400, str(exc)) from None
    frames = resize_to(torch.stack(images).permute(0, 3, 1, 2), size)
    if len(urls) % TEMPORAL_PATCH_SIZE:
        frames = torch.cat([frames, frames[-1:]])
    return DecodedVideo(frames.contiguous(), fps, image_patch_size=spec.image_patch_size)


@functools.lru_cache(maxsize=8)
def patch_size(model_path: str) -> int | None:
    """The vision tower's patch side of the checkpoint at ``model_path`` (Qwen2.5-VL and
    InternVL3 14, Qwen3-VL 16); None without a readable ``config.json`` there."""
    from apbv import cost

    try:
        return cost.model_dims(cost.read_config(model_path)).patch_size
    except (OSError, ValueError, KeyError):
        return None


def _read(index: int, url: str, limits: Limits, policy: MediaPolicy) -> torch.Tensor:
    """uint8 (H, W, 3) of image part ``index``: a ``data:`` image or a local file."""
    where = f"image {index}"
    if url[:5].lower() == "data:":
        head, comma, payload = url.partition(",")
        kind, _, encoding = head[5:].partition(";")
        if not comma or encoding.lower() != "base64" or kind.lower() not in IMAGE_TYPES:
            raise ClientError(400, f"{where}: a data: image URL must be data:<type>;base64,"
                                   f"<bytes> with a type in {sorted(IMAGE_TYPES)}, got "
                                   f"{head[:80]!r}")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ClientError(400, f"{where}: the data: URL's base64 payload is malformed: "
                                   f"{exc}") from None
        return decode_image(data, where, limits)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise ClientError(400, f"{where}: remote image URLs are not fetched; send the image "
                               "inline (data:image/png;base64,...) or as a file:// URL under a "
                               "--media-root")
    path = resolve_media(url, policy)
    limits.check("data", os.path.getsize(path), limits.max_data_bytes, "max-data-bytes",
                 f"{where}'s file")
    with open(path, "rb") as f:
        return decode_image(f.read(), where, limits)
