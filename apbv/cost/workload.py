"""What one request asks of the cost model: :class:`Workload`, a pure record checked once
(:meth:`Workload.of`), and the keep rate of pruned video (:data:`KEEP_BY`).

The keep rate is the fraction of the video's tokens that reach the prompt (1: unpruned). How the
rest go decides what the vision tower does:

- ``patch`` (``video.static_threshold``, :mod:`apbv.video.prune`): whole temporal patches are
  dropped *before* the tower. Each rank still decodes its whole share of frames, but encodes
  only its kept patches; the prompt, the KV, the transfer and the decode shrink with them.
- ``token`` (``video.pruning_rate``, vLLM's ``video_pruning_rate``; keep rate ``1 - rate``):
  tokens are dropped *after* the tower, which still encodes every patch; each patch keeps about
  ``keep_rate`` of its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from apbv.cost.work import squarest_grid

KEEP_BY = ("patch", "token")
"""How pruned video tokens go: whole temporal patches before the tower, or tokens after it."""
VISION_ATTENTION = ("grouped", "per_window")


@dataclass(frozen=True)
class Workload:
    """One request as the cost model prices it (:func:`apbv.cost.predict.estimate`).

    ``context_len`` is the whole video's prompt (N before any pruning): the keep rate takes
    the dropped video tokens (and the text that goes with their patches) out of it.
    """

    context_len: int
    query_len: int
    world_size: int
    """H of the comparison (``full`` runs as one process on the hardware's share of H)."""
    frames: int
    """Sampled frames (a whole number of temporal patches); 0: no video."""
    grid: tuple[int, int]
    """Merged-token (rows, cols) of a frame ((0, 0) without video)."""
    source_pixels: int | None = None
    """Pixels decoded per sampled frame; None: the resized frame's."""
    video_start: int | None = None
    """Context tokens before the video; None: the model's (``dims.video_start``)."""
    anchor_len: int | None = None
    passing_len: int | None = None
    vision_attention: str = "grouped"
    pipeline: bool = False
    answer_tokens: int = 1
    walked_frames: tuple[int, ...] | None = None
    walked_intervals: tuple[int, ...] | None = None
    dtype_bytes: int | None = None
    """Element size; None: the hardware's."""
    keep_rate: float = 1.0
    """Fraction of the video's tokens kept in the prompt (1: unpruned)."""
    keep_by: str = "patch"
    """One of :data:`KEEP_BY`."""

    def __post_init__(self) -> None:
        if self.vision_attention not in VISION_ATTENTION:
            raise ValueError(f"vision_attention must be grouped or per_window, got "
                             f"{self.vision_attention!r}")
        if self.keep_by not in KEEP_BY:
            raise ValueError(f"keep_by must be one of {', '.join(KEEP_BY)}, got "
                             f"{self.keep_by!r}")
        rate = self.keep_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1:
            raise ValueError(f"keep_rate must be a fraction in (0, 1] of the video tokens "
                             f"kept (1: unpruned), got {rate!r}")

    @property
    def tokens_per_patch(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def pruned(self) -> bool:
        return self.frames > 0 and self.keep_rate < 1

    @classmethod
    def of(cls, dims: Any, *, context_len: int, query_len: int, world_size: int, frames: int,
           tokens_per_patch: int | None = None, grid: tuple[int, int] | None = None,
           walked_frames: Sequence[int] | None = None,
           walked_intervals: Sequence[int] | None = None, **fields: Any) -> Workload:
        """The workload with its frame grid resolved: ``grid``, or the :func:`squarest_grid`
        of ``tokens_per_patch`` (only the vision windows depend on the shape). ValueError
        naming frames that are not whole temporal patches of ``dims``, or a video without
        either."""
        unit = dims.temporal_patch_size  # frames per temporal patch (InternVL3: 1)
        if isinstance(frames, bool) or not isinstance(frames, int) or frames < 0 \
                or frames % unit:
            raise ValueError(f"frames must be an {'even ' if unit == 2 else ''}integer >= 0 "
                             f"({unit} frames per temporal patch), got {frames!r}")
        if grid is None:
            if not frames:
                grid = (0, 0)
            elif tokens_per_patch is None:
                raise ValueError("a prompt with video needs tokens_per_patch or grid")
            else:
                grid = squarest_grid(tokens_per_patch)
        elif tokens_per_patch is not None and tokens_per_patch != grid[0] * grid[1]:
            raise ValueError(f"tokens_per_patch ({tokens_per_patch}) differs from grid {grid}")
        return cls(context_len=context_len, query_len=query_len, world_size=world_size,
                   frames=frames, grid=(grid[0], grid[1]),
                   walked_frames=None if walked_frames is None else tuple(walked_frames),
                   walked_intervals=None if walked_intervals is None
                   else tuple(walked_intervals), **fields)
