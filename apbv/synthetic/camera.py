"""Static-camera needle videos at the tiny model's size (pure, seeded): a fixed scene where
one thing happens.

A video is ``patches`` temporal patches of 2 frames (``FRAME_SIZE`` pixels square, 2 fps, as
:mod:`apbv.synthetic.needles`), drawn as a fixed surveillance camera records them, with a
1080p camera's scene statistics scaled to 56 x 56 pixels:

- **scene**: a smooth luma/colour field (a 7 x 7 random grid, bilinear), a few flat
  rectangles with sharp edges (a door, a parked car, a window) and a fixed fine texture of
  +-``TEXTURE`` levels; the same in every frame;
- **sensor noise**: independent Gaussian noise of ``NOISE`` levels (standard deviation) on
  every pixel of every frame;
- **lighting drift**: the whole frame brightens or darkens slowly, by up to ``DRIFT`` levels
  over the video (a cloud, the evening), with a sinusoidal part;
- **compression**: per 8 x 8 block a DC offset of +-``BLOCK`` levels that changes at every
  keyframe (every ``GOP`` temporal patches), and every level rounded to a multiple of
  ``QUANT`` (a codec's blockiness and banding);
- **the event**, at a random time (never in the first patch): ``flash``, a coloured light
  flooding the frame for one temporal patch (``FLASH_MIX`` of the colour over the scene), or
  ``object``, a square of ``OBJECT_SIDE`` pixels in the colour crossing the frame at a
  constant speed for ``OBJECT_PATCHES`` temporal patches.

The question is :data:`QUESTIONS` of the event's kind, the answer its colour name (one of
:data:`apbv.synthetic.needles.COLOURS`). A sample is a pure function of ``(seed, kind,
index, patches)`` (``colour`` forces the event's colour, drawn from the same generator).
"""

from __future__ import annotations

import numpy as np
import torch

from apbv.synthetic.needles import COLOURS, FRAME_SIZE, NeedleSample

CAMERA_KINDS = ("flash", "object")
QUESTIONS = {"flash": "What colour is the flash?",
             "object": "What colour is the moving object?"}
NOISE = 2.0
"""Sensor noise, standard deviation in levels (0-255)."""
TEXTURE = 6
DRIFT = 12.0
"""Largest lighting change over a video, in levels."""
BLOCK = 2
"""Half-width of a compression block's DC offset, in levels."""
QUANT = 2
GOP = 4
"""Temporal patches per keyframe interval (the block offsets change at each keyframe)."""
FLASH_MIX = 0.75
OBJECT_SIDE = 16
OBJECT_PATCHES = 6
MIN_PATCHES = 8


def _check(kind: str, patches: int, colour: str | None) -> None:
    if kind not in CAMERA_KINDS:
        raise ValueError(f"unknown camera event {kind!r}; allowed: {', '.join(CAMERA_KINDS)}")
    if isinstance(patches, bool) or not isinstance(patches, int) or patches < MIN_PATCHES:
        raise ValueError(f"patches must be an integer >= {MIN_PATCHES}, got {patches!r}")
    if colour is not None and colour not in COLOURS:
        raise ValueError(f"unknown colour {colour!r}; allowed: {', '.join(COLOURS)}")


def _scene(rng: np.random.Generator) -> np.ndarray:
    """float32 (S, S, 3) levels: the fixed scene."""
    size = FRAME_SIZE
    coarse = torch.from_numpy(rng.uniform(50, 190, size=(1, 3, 7, 7)).astype(np.float32))
    tint = torch.from_numpy(rng.uniform(-25, 25, size=(1, 3, 1, 1)).astype(np.float32))
    grey = coarse.mean(dim=1, keepdim=True)
    field = torch.nn.functional.interpolate(grey * 0.8 + coarse * 0.2 + tint, size=(size, size),
                                            mode="bilinear", align_corners=False)[0]
    scene = field.permute(1, 2, 0).numpy().copy()
    for _ in range(int(rng.integers(2, 5))):  # flat objects with sharp edges
        h, w = (int(x) for x in rng.integers(6, 24, size=2))
        y, x = int(rng.integers(0, size - h)), int(rng.integers(0, size - w))
        scene[y:y + h, x:x + w] = rng.uniform(30, 210) + rng.uniform(-15, 15, size=3)
    scene += rng.integers(-TEXTURE, TEXTURE + 1, size=(size, size, 1))
    return scene.astype(np.float32)


def _draw(kind: str, patches: int, seed: int, index: int, colour: str | None
          ) -> tuple[np.random.Generator, str, int]:
    rng = np.random.default_rng([seed, 100 + CAMERA_KINDS.index(kind), index, patches])
    names = list(COLOURS)
    drawn = names[int(rng.integers(len(names)))]
    span = 1 if kind == "flash" else min(OBJECT_PATCHES, patches - 1)
    start = int(rng.integers(1, patches - span + 1))
    return rng, colour or drawn, start


def camera_sample(kind: str, *, patches: int, seed: int, index: int,
                  colour: str | None = None) -> NeedleSample:
    """Static-camera sample ``index`` with a ``kind`` event (see the module docstring)."""
    _check(kind, patches, colour)
    rng, name, start = _draw(kind, patches, seed, index, colour)
    size = FRAME_SIZE
    scene = _scene(rng)
    rgb = np.array(COLOURS[name], dtype=np.float32)
    frames = 2 * patches
    amplitude, phase = rng.uniform(-DRIFT, DRIFT), rng.uniform(0, 2 * np.pi)
    t = np.arange(frames, dtype=np.float32) / max(1, frames - 1)
    drift = amplitude * (0.7 * t + 0.3 * np.sin(2 * np.pi * t + phase) - 0.3 * np.sin(phase))
    blocks = size // 8
    offsets = rng.integers(-BLOCK, BLOCK + 1, size=(-(-patches // GOP), blocks, blocks, 1))
    x0, y0 = int(rng.integers(0, size - OBJECT_SIDE)), int(rng.integers(0, size - OBJECT_SIDE))
    vx, vy = (int(v) for v in rng.integers(-4, 5, size=2))
    video = np.empty((frames, size, size, 3), dtype=np.uint8)
    for f in range(frames):
        patch = f // 2
        frame = scene + drift[f]
        frame = frame + np.kron(offsets[patch // GOP], np.ones((8, 8, 1)))
        if kind == "flash" and patch == start:
            frame = frame * (1 - FLASH_MIX) + rgb * FLASH_MIX
        elif kind == "object" and start <= patch < start + OBJECT_PATCHES:
            step = patch - start
            x = int(np.clip(x0 + vx * step, 0, size - OBJECT_SIDE))
            y = int(np.clip(y0 + vy * step, 0, size - OBJECT_SIDE))
            frame[y:y + OBJECT_SIDE, x:x + OBJECT_SIDE] = rgb
        frame = frame + rng.normal(0.0, NOISE, size=frame.shape)
        video[f] = np.clip(np.round(frame / QUANT) * QUANT, 0, 255).astype(np.uint8)
    needles = tuple((p, name) for p in range(start, min(patches, start + (
        1 if kind == "flash" else OBJECT_PATCHES))))
    return NeedleSample(kind=f"camera_{kind}", question=QUESTIONS[kind], answer=name,
                        frames=torch.from_numpy(video).permute(0, 3, 1, 2).contiguous(),
                        needles=needles)
