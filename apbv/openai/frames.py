"""Frames a client pushes to a live stream: base64 PNG or JPEG images in a JSON body, decoded,
checked and resized to the stream's frame size before anything reaches a rank.

Body of ``POST /v1/streams/{id}/frames``: ``{"frames": [base64 image, ...], "timestamps":
[seconds, ...]}``; ``timestamps`` is optional (absent: the frames follow the stream's last one
at ``1 / fps`` steps, the first push starting at 0); they are bounded as
:func:`apbv.engine.stream_plan.check_timestamps` says (finite, within +-1e10 s, each after the
previous by at most an hour). Every frame of a stream has one native
size (stated at open as ``width`` / ``height``, else fixed by the first push) and is resized to
the stream's size with the one-shot path's resize (torchvision bicubic with antialias on the
uint8 frame); a frame already at that size is passed on untouched, pixel for pixel.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass

import torch

from apbv.engine.stream_plan import check_timestamps
from apbv.openai.policy import ClientError, Limits
from apbv.video.load import resize_frames

FORMATS = ("PNG", "JPEG")
@dataclass(frozen=True)
class Push:
    frames: torch.Tensor
    """uint8 (F, 3, h, w) at the stream's size."""
    timestamps: list[float]
    native: tuple[int, int]
    """(H, W) of the pushed images."""


def _image(index: int, item: object, limits: Limits) -> torch.Tensor:
    """uint8 (H, W, 3) of one base64 PNG/JPEG, or ClientError."""
    if not isinstance(item, str) or not item:
        raise ClientError(400, f"frames[{index}] must be a base64 PNG or JPEG string")
    try:
        data = base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError):
        raise ClientError(400, f"frames[{index}] is not valid base64") from None
    return decode_image(data, f"frames[{index}]", limits)


def decode_image(data: bytes, where: str, limits: Limits) -> torch.Tensor:
    """uint8 (H, W, 3) RGB of one PNG or JPEG image, its pixel count checked from its header
    before it is decoded (``--max-push-frame-pixels``); ClientError 400 naming ``where``."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        if image.format not in FORMATS:
            raise ClientError(400, f"{where} is a {image.format} image; only "
                                   f"{' and '.join(FORMATS)} are accepted")
        width, height = image.size  # from the header: nothing decoded yet
        limits.check("frame pixels", width * height, limits.max_push_frame_pixels,
                     "max-push-frame-pixels", f"{where}'s pixel count ({width}x{height})")
        pixels = image.convert("RGB").tobytes()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ClientError(400, f"{where} is not a readable PNG or JPEG: {exc}") from None
    return torch.frombuffer(bytearray(pixels), dtype=torch.uint8).view(height, width, 3)


def parse_push(body: object, limits: Limits, native: tuple[int, int] | None,
               size: tuple[int, int] | None, last_ts: float | None, fps: float) -> Push:
    """The frames of one push body, checked against the stream: ``native`` (H, W) the images
    must have (None: this push fixes it), ``size`` (h, w) they are resized to (None: derived
    by the caller from the native size, so frames stay native here), ``last_ts`` the stream's
    newest timestamp (None before the first frame)."""
    if not isinstance(body, dict) or set(body) - {"frames", "timestamps"}:
        raise ClientError(400, "the body must be a JSON object {\"frames\": [base64 PNG/JPEG, "
                               "...], \"timestamps\": [seconds, ...] (optional)}")
    items = body.get("frames")
    if not isinstance(items, list) or not items:
        raise ClientError(400, "frames must be a non-empty list of base64 PNG or JPEG images")
    limits.check("frames", len(items), limits.max_frames_per_push, "max-frames-per-push",
                 "the number of frames in one push")
    stamps = body.get("timestamps")
    if stamps is None:
        start = 0.0 if last_ts is None else last_ts + 1 / fps
        stamps = [start + i / fps for i in range(len(items))]
    elif not isinstance(stamps, list) or len(stamps) != len(items) or not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
            for t in stamps):
        raise ClientError(400, f"timestamps must be a list of {len(items)} finite numbers (one "
                               "per frame), or absent")
    try:
        stamps = check_timestamps(stamps, last_ts)
    except ValueError as exc:
        raise ClientError(400, str(exc)) from None
    images = [_image(i, item, limits) for i, item in enumerate(items)]
    want = native or tuple(images[0].shape[:2])
    for i, image in enumerate(images):
        if tuple(image.shape[:2]) != want:
            where = "the stream's frame size" if native else "frames[0]'s size"
            raise ClientError(400, f"frames[{i}] is {image.shape[1]}x{image.shape[0]}, but "
                                   f"{where} is {want[1]}x{want[0]}: every frame of a stream "
                                   "has one size")
    batch = torch.stack(images).permute(0, 3, 1, 2)  # (F, 3, H, W), channels-last strides
    if size is not None:
        batch = resize_to(batch, size)
    return Push(batch.contiguous(), stamps, (want[0], want[1]))


def resize_to(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Frames (F, 3, H, W) uint8 at ``size`` (h, w), contiguous: the one-shot path's resize,
    or the frames themselves when they already have that size."""
    if tuple(frames.shape[2:]) != tuple(size):
        frames = resize_frames(frames, size)
    return frames.contiguous()
