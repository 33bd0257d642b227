"""Temporal pruning: which temporal patches of a video changed enough to be encoded (pure).

A fixed camera repeats most of itself. With ``video.static_threshold`` T > 0, a temporal patch
(the vision tower's unit: 2 frames for Qwen2.5-VL and Qwen3-VL, 1 for InternVL3) whose change
from the last *kept* patch is below T is dropped before the tower: it is not encoded, it has no
tokens in the prompt, and the kept patches keep the positions and text they would have had.

The change, in levels (0-255) of a colour channel:

- each channel of each frame is averaged over the cells of the family's merged-patch grid
  (gh, gw): one cell per LLM token of a frame, a downscaled copy in which uncorrelated sensor
  noise of s levels shrinks to about s / (cell side in pixels), so noise and codec grain do
  not count as change;
- a temporal patch's *signature* (3, gh, gw) is the mean of its frames' cells
  (:func:`signatures`);
- its *change* is the largest absolute difference, over the channels and cells, between its
  signature and the last kept patch's (:func:`keep_mask`): a small object appearing in one
  cell counts in full, not diluted by the rest of the frame, and a change of colour counts
  even where the brightness stays (a magenta light on a grey wall of the same luma).

The first temporal patch of the video is always kept. The rule reads the signatures of the
whole video in order, so it gives the same keep mask whatever the number of ranks: each rank
computes the signatures of its own frames, the ranks all-gather them (a few hundred bytes per
patch: :func:`apbv.comm.all_gather_rows`) and every rank applies the rule to all of them, which
also judges each rank's first patch against the last kept patch before it.

``video.pruning_rate`` R in (0, 1) (vLLM's ``video_pruning_rate``, NVIDIA's EVS) removes the
fraction R of the video tokens that changed least, one LLM token at a time
(:func:`token_mask`): a token's *score* is the largest absolute difference, over the channels,
between its cell of the signature and the same cell of the previous temporal patch still in
play (the previous one of the video; with a threshold too, the previous kept one: the
threshold drops whole patches first and the rate applies to the tokens of the rest). The first
patch in play is kept whole; of the others' tokens the highest scores stay, ties to the earlier
token (deterministic); the count kept is max(tokens of a patch, n - floor(R * n)) of the n
tokens in play (R read as its decimal text, so 0.29 of 100 removes 29). A patch with no kept
token is dropped whole (its text goes with it). The tower still encodes whole patches (its
windowed attention wants whole grids): the rows of the pruned tokens are dropped after it
(:mod:`apbv.engine.pruned`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import torch

from apbv.plan import Range

_FRAMES_PER_STEP = 4
"""Frames made float and pooled at once (bounds the float copy of native-size frames)."""


def signatures(frames: torch.Tensor, unit: int, cells: tuple[int, int]) -> torch.Tensor:
    """(P, 3, gh, gw) float32 on the CPU: per temporal patch of ``unit`` frames, the mean over
    its frames of each channel's level averaged over each of the ``cells`` (gh, gw) grid's
    cells (see the module docstring). ``frames``: uint8 (P * unit, 3, H, W), RGB, any device;
    each frame is pooled alone, so a frame's cells do not depend on the frames beside it."""
    count, channels = frames.shape[0], frames.shape[1]
    assert channels == 3 and count % unit == 0, (frames.shape, unit)
    pooled = []
    for start in range(0, count, _FRAMES_PER_STEP):
        chunk = frames[start:start + _FRAMES_PER_STEP].float()
        pooled.append(torch.nn.functional.adaptive_avg_pool2d(chunk, cells).cpu())
    per_frame = torch.cat(pooled) if pooled else torch.zeros(0, 3, *cells)
    return per_frame.view(count // unit, unit, 3, *cells).mean(dim=1)


def keep_mask(sigs: torch.Tensor, threshold: float) -> list[bool]:
    """Per temporal patch of the whole video (``sigs`` (P, ...): :func:`signatures`, in order),
    whether it is kept: the first always; a later one when the largest difference from the last
    kept patch's signature is at least ``threshold`` (levels 0-255; > 0)."""
    assert threshold > 0 and sigs.dim() >= 2, (threshold, sigs.shape)
    keep: list[bool] = []
    last: torch.Tensor | None = None
    for sig in sigs:
        kept = last is None or float((sig - last).abs().max()) >= threshold
        keep.append(kept)
        if kept:
            last = sig
    return keep


def kept_split(keep: Sequence[bool], ranges: Sequence[Range]) -> tuple[tuple[int, ...],
                                                                         tuple[Range, ...]]:
    """(the kept temporal patches' indices in the video, per rank its kept patches [k0, k1)
    counted among the kept ones) for the frame split ``ranges`` (per rank [p0, p1) of the
    video's patches; every rank (0, P) when the vision work is not split). A rank may keep
    none: (k, k)."""
    kept = tuple(i for i, k in enumerate(keep) if k)
    before = [0]
    for k in keep:
        before.append(before[-1] + int(k))
    return kept, tuple((before[p0], before[p1]) for p0, p1 in ranges)


def pruned_grid(grid: tuple[int, int, int], kept: Sequence[int] | None) -> tuple[int, int, int]:
    """The (t, h, w) patch grid ``grid`` of a video with only its ``kept`` temporal patches
    (None: all of them)."""
    if kept is None:
        return grid
    assert kept and all(0 <= g < grid[0] for g in kept), (kept, grid)
    return len(kept), grid[1], grid[2]


def token_mask(sigs: torch.Tensor, keep: Sequence[bool], rate: float) -> torch.Tensor:
    """(K, gh * gw) bool: per temporal patch in play (``keep``, K of them: the threshold's
    mask, or every patch), whether each of its LLM tokens (row-major over the merged grid)
    stays at ``rate`` (in [0, 1); see the module docstring). ``sigs`` (P, 3, gh, gw): the whole
    video's :func:`signatures`, in order; the same on every rank, so is the mask."""
    assert 0 <= rate < 1 and len(keep) == len(sigs) and any(keep), (rate, len(keep), sigs.shape)
    played = sigs[torch.tensor(list(keep), dtype=torch.bool)].flatten(2)  # (K, 3, S)
    count, per_patch = played.shape[0], played.shape[2]
    scores = torch.full((count, per_patch), math.inf)
    if count > 1:
        scores[1:] = (played[1:] - played[:-1]).abs().amax(dim=1)
    total = count * per_patch
    kept = max(per_patch, total - math.floor(Fraction(str(float(rate))) * total))
    order = torch.argsort(scores.flatten(), descending=True, stable=True)
    mask = torch.zeros(total, dtype=torch.bool)
    mask[order[:kept]] = True
    return mask.view(count, per_patch)


def prune_tokens(keep: Sequence[bool], mask: torch.Tensor) -> tuple[list[bool], torch.Tensor]:
    """(the temporal patches with a kept token: ``keep`` less those whose row of ``mask``
    (:func:`token_mask`, one row per patch in ``keep``) is empty, the rows of those patches)."""
    assert len(mask) == sum(keep), (len(mask), sum(keep))
    rows = iter(mask.any(dim=1).tolist())
    out = [bool(k and next(rows)) for k in keep]
    return out, mask[mask.any(dim=1)]
