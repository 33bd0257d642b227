"""The memory a live stream reserves on each rank of its replica, and the budget it must fit.

A stream's KV lives on the ranks for as long as it is open, so each open stream reserves its
worst case per rank, in KV bytes (2 x layers x KV heads x head dim x the dtype's bytes per
token): the video tokens its window keeps per rank, plus one largest push (a chunk lands whole
on one rank before the window evicts anything):

- ``window_tokens``: that many per rank (the engine keeps the average at or below it);
- ``window_s``: the temporal units of ``window_s`` seconds at ``fps`` (the family's frames a
  unit: two for Qwen2.5-VL, one for InternVL3; plus one), spread over the ranks;
- both: the smaller; neither (or a window wider than that): the model's context spread over
  the ranks (a stream never holds more: the engine refuses a chunk past the context).

Frame size unknown at open (the first push fixes it): the largest frame the stream allows
(its ``max_pixels``, else ``--max-pixels-per-frame``) until then. A unit's tokens
(:meth:`KVSizing.unit_tokens`) follow the frame size (one per merged patch of the family:
(patch x merge)^2 pixels, 28x28 for Qwen2.5-VL, 32x32 for Qwen3-VL), or not at all where
every frame is one fixed tile (InternVL3: 256 video tokens and its ``FrameN: <img>`` ... text,
whatever the frame size). A stream opened with ``keep_vision`` also holds its chunks' tower
rows on their owners: per token the embedding and its extra levels (hidden x (1 + DeepStack
levels) values, Qwen3-VL's 3 levels: 4 x hidden), counted with the KV of each token.

The frame size itself follows the family too (:meth:`KVSizing.frame_size`: sides multiples of
patch x 2, the one-shot path's resize rule with the family's patch size).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from apbv.openai.policy import ClientError
from apbv.video.sampling import stream_frame_size

if TYPE_CHECKING:
    from apbv.cost.work import ModelDims

GIB = 1024**3


def default_budget_gb(memory_gb: float | None, world_size: int) -> float:
    """Half of ``parallel.memory_gb`` when set, else a quarter of this host's memory shared by
    the ranks of one replica."""
    if memory_gb is not None:
        return memory_gb / 2
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host / 4 / world_size / GIB


@dataclass(frozen=True)
class KVSizing:
    """A served family's stream sizes, from its checkpoint's config: the frame size rule and
    the bytes a stream reserves per rank."""

    kv_bytes_per_token: int
    max_positions: int
    world_size: int
    max_frames_per_push: int
    frames_per_unit: int = 2
    """Frames per temporal unit of the family (Qwen2.5-VL 2, InternVL3 1)."""
    tile_tokens: int | None = None
    """Rows per unit when every frame is one fixed tile (InternVL3: its video tokens plus the
    text around them); None: they follow the frame size."""
    patch_size: int = 14
    """The vision tower's patch side (pixels; Qwen2.5-VL and InternVL3 14, Qwen3-VL 16)."""
    spatial_merge_size: int = 2
    """Patches merged into one video token along each side."""
    vision_bytes_per_token: int = 0
    """Bytes of one video token's kept tower row (hidden x (1 + extra levels) x the dtype's
    bytes), held per token by a stream opened with ``keep_vision``."""

    @classmethod
    def of_checkpoint(cls, model_dir: str, dtype_bytes: int, world_size: int,
                      max_frames_per_push: int) -> KVSizing:
        from apbv import cost

        config = cost.read_config(model_dir)
        text = config.get("text_config") or config
        positions = text.get("max_position_embeddings") or config["max_position_embeddings"]
        return cls.of_dims(cost.model_dims(config), int(positions), dtype_bytes, world_size,
                           max_frames_per_push)

    @classmethod
    def of_dims(cls, dims: ModelDims, max_positions: int, dtype_bytes: int, world_size: int,
                max_frames_per_push: int) -> KVSizing:
        """From a family's :class:`apbv.cost.ModelDims` (a config's or a preset's) and its
        context length (positions); ValueError for a merge the resize rule cannot follow."""
        if dims.spatial_merge_size != 2:  # qwen-vl-utils' resize sizes frames for a 2 x 2 merge
            raise ValueError(f"live streams need a spatial_merge_size of 2 (the resize rule's), "
                             f"the checkpoint has {dims.spatial_merge_size}")
        tile = None
        if dims.frame_side is not None:
            side = dims.frame_side // dims.patch_size // dims.spatial_merge_size
            tile = side * side + dims.unit_text_tokens
        return cls(2 * dims.layers * dims.kv_heads * dims.head_dim * dtype_bytes,
                   max_positions, world_size, max_frames_per_push,
                   dims.temporal_patch_size, tile, dims.patch_size, dims.spatial_merge_size,
                   dims.embedding_width * dtype_bytes)

    @property
    def frame_multiple(self) -> int:
        """A stream's frame sides are multiples of this (pixels): patch x merge."""
        return self.patch_size * self.spatial_merge_size

    def frame_size(self, height: int, width: int, *, min_pixels: int | None = None,
                   max_pixels: int | None = None) -> tuple[int, int]:
        """(h, w) every frame of a stream of native ``height`` x ``width`` frames is resized to:
        :func:`apbv.video.sampling.stream_frame_size` with the family's patch size (sides
        multiples of :attr:`frame_multiple`); ValueError for bad values."""
        return stream_frame_size(height, width, min_pixels=min_pixels, max_pixels=max_pixels,
                                 image_patch_size=self.patch_size)

    def unit_tokens(self, pixels: int) -> int:
        """Rows a temporal unit of frames of ``pixels`` pixels adds to a stream: one per merged
        patch ((patch x merge)^2 pixels), or the fixed tile's."""
        if self.tile_tokens is not None:
            return self.tile_tokens
        return max(1, pixels // self.frame_multiple ** 2)

    def tokens_per_rank(self, tokens_per_patch: int, fps: float, window_s: float | None,
                        window_tokens: int | None) -> int:
        windows = [math.ceil(self.max_positions / self.world_size)]  # the engine's ceiling
        if window_tokens is not None:
            windows.append(window_tokens)
        frames = None if window_s is None else window_s * fps  # inf past the float range
        unit = self.frames_per_unit
        if frames is not None and frames / unit < self.max_positions:  # else the context
            patches = math.ceil(frames / unit) + 1
            windows.append(math.ceil(patches * tokens_per_patch / self.world_size))
        kept = min(windows)
        push = (self.max_frames_per_push + unit - 1) // unit * tokens_per_patch
        return kept + push

    def need(self, tokens_per_patch: int, fps: float, window_s: float | None,
             window_tokens: int | None, keep_vision: bool = False) -> int:
        """Bytes per rank a stream reserves: each token's KV, and with ``keep_vision`` its
        kept tower row (:attr:`vision_bytes_per_token`)."""
        per_token = self.kv_bytes_per_token + (self.vision_bytes_per_token if keep_vision else 0)
        return per_token * self.tokens_per_rank(tokens_per_patch, fps, window_s, window_tokens)


def human(num_bytes: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes / 1024:.1f} KiB"


def check_fits(need: int, held: int, budget: int, streams: int) -> None:
    """ClientError 507 when ``need`` more bytes per rank pass the budget."""
    if held + need > budget:
        raise ClientError(507, (
            f"the stream would reserve {human(need)} of KV per rank, and the {streams} open "
            f"stream(s) of the least loaded replica hold {human(held)} of the {human(budget)} "
            "per-rank stream budget (--stream-memory-gb): lower "
            "window_tokens or window_s, the frame size (max_pixels) or fps, or close a stream"))


def describe(need: int, budget: int) -> dict[str, Any]:
    return {"reserved_gb_per_rank": need / GIB, "budget_gb_per_rank": budget / GIB}
