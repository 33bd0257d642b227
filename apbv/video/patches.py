"""Resized uint8 frames -> the vision tower's normalised patch rows, in few passes over memory.

The rows equal the HF video processor's (``pixel_values_videos``) bit for bit: the same
float32 arithmetic per element, ``(x - 255 * mean) / (255 * std)``, only arranged so that the
patch layout is built on the uint8 frames (a quarter of the bytes) and the float tensor is
written once and normalised in place. Work is cut into chunks of temporal patches, which a
thread pool processes in parallel (``workers``), each chunk into its own rows of the output.

``levels=True`` stops before the arithmetic: the rows hold the pixel levels themselves, as
int8 ``x - 128`` (a quarter of the float rows' bytes, one pass over the frames), for a patch
embedding that folds the normalisation into its kernel (:mod:`apbv.model.common.patch_embed`);
:func:`levels_to_rows` turns them into the processor's float rows, bit for bit.

Row order: temporal patch, merged row, merged column, row inside the merge square, column
inside it; each row holds (channel, frame of the temporal patch, patch row, patch column).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

PIPELINE_CHUNK_ROWS = 32768
"""Patch rows per chunk of a rank's in-rank pipeline (``vision.pipeline``) where the vision
tower takes the whole video in one call (``vision.chunk_rows`` 0, as on GPUs)."""



def patches_per_chunk(rows_per_patch: int, chunk_rows: int) -> int:
    """Whole temporal patches in a chunk of about ``chunk_rows`` patch rows when each temporal
    patch has ``rows_per_patch`` rows: at least one (the vision tower's calls, the in-rank
    pipeline's chunks and the cost model's use this one rule)."""
    return max(1, chunk_rows // rows_per_patch)


@dataclass(frozen=True)
class PatchSpec:
    """The processor settings that decide the rows."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale_factor: float

    def scaled(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and std times 1 / rescale_factor, float32 (3,), as the processor fuses them."""
        mean = torch.tensor(self.mean, device=device) * (1.0 / self.rescale_factor)
        std = torch.tensor(self.std, device=device) * (1.0 / self.rescale_factor)
        return mean, std


def _pad_frames(frames: torch.Tensor, temporal: int) -> torch.Tensor:
    if pad := -frames.shape[0] % temporal:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    return frames


def _rows_u8(frames: torch.Tensor, spec: PatchSpec) -> torch.Tensor:
    """(2k, 3, H, W) uint8 -> (k * h * w, 3, 2, p, p) uint8 in the tower's row order."""
    f, c, height, width = frames.shape
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    hm, wm = height // (p * m), width // (p * m)
    # axes: t, tp, c, hm, m(h), p(h), wm, m(w), p(w)
    view = frames.reshape(f // tp, tp, c, hm, m, p, wm, m, p)
    rows = view.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, hm, wm, m(h), m(w), c, tp, p(h), p(w)
    return rows.reshape(-1, c, tp, p, p)


def _normalise(target: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> None:
    """Float rows (n, 3, ...) holding pixel levels -> the processor's rows, in place."""
    shape = (1, 3) + (1,) * (target.dim() - 2)
    target.sub_(mean.view(shape)).div_(std.view(shape))


def _fill(out: torch.Tensor, frames: torch.Tensor, spec: PatchSpec, mean: torch.Tensor,
          std: torch.Tensor) -> None:
    rows = _rows_u8(frames, spec)
    if out.dtype == torch.int8:  # levels: x - 128 is x with its top bit flipped
        torch.bitwise_xor(rows, 0x80, out=out.view(torch.uint8).view(rows.shape))
        return
    target = out.view(rows.shape)
    target.copy_(rows)
    _normalise(target, mean, std)


def levels_to_rows(levels: torch.Tensor, spec: PatchSpec) -> torch.Tensor:
    """int8 level rows (n, 3 * tp * p * p) of ``patch_rows(..., levels=True)`` -> the float32
    rows ``patch_rows`` makes of the same frames, bit for bit, on the levels' device."""
    rows = levels.to(torch.float32).add_(128.0)  # the uint8 levels, exactly
    _normalise(rows.view(rows.shape[0], 3, -1), *spec.scaled(levels.device))
    return rows


def patch_rows(frames: torch.Tensor, spec: PatchSpec, *, workers: int = 1,
               chunk_patches: int = 8, device: torch.device | None = None,
               levels: bool = False) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Resized frames (F, 3, H, W) uint8 -> float32 rows (t * h * w, 3 * tp * p * p) and the
    (t, h, w) patch grid; an odd frame count is padded with the last frame (as the processor
    does). ``device``: where the rows are made (default: the frames' device). ``levels``:
    int8 rows of the levels minus 128 instead (see the module notes)."""
    device = frames.device if device is None else device
    frames = _pad_frames(frames, spec.temporal_patch_size).to(device)
    f, c, height, width = frames.shape
    p, tp = spec.patch_size, spec.temporal_patch_size
    grid = (f // tp, height // p, width // p)
    per_patch = grid[1] * grid[2]
    out = torch.empty((grid[0] * per_patch, c * tp * p * p), device=device,
                      dtype=torch.int8 if levels else torch.float32)
    mean, std = spec.scaled(device)
    chunks = [(t, min(t + chunk_patches, grid[0])) for t in range(0, grid[0], chunk_patches)]

    def one(bounds: tuple[int, int]) -> None:
        lo, hi = bounds
        _fill(out[lo * per_patch:hi * per_patch], frames[lo * tp:hi * tp], spec, mean, std)

    if workers <= 1 or len(chunks) == 1 or device.type != "cpu":
        for bounds in chunks:
            one(bounds)
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(one, chunks))
    return out, grid
