"""The memory a live stream reserves on each rank of its replica, and the budget it must fit.

A stream's KV lives on the ranks for as long as it is open, so each open stream reserves its
worst case per rank, in KV bytes (2 x layers x KV heads x head dim x the dtype's bytes per
token): the video tokens its window keeps per rank, plus one largest push (a chunk lands whole
on one rank before the window evicts anything):

- ``window_tokens``: that many per rank (the engine keeps the average at or below it);
- ``window_s``: the patches of ``window_s`` seconds at ``fps`` (two frames a patch, plus one),
  spread over the ranks;
- both: the smaller; neither (or a window wider than that): the model's context spread over
  the ranks (a stream never holds more: the engine refuses a chunk past the context).

Frame size unknown at open (the first push fixes it): the largest frame the stream allows
(its ``max_pixels``, else ``--max-pixels-per-frame``) until then.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from apbv.serve.policy import ClientError

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
    kv_bytes_per_token: int
    max_positions: int
    world_size: int
    max_frames_per_push: int

    @classmethod
    def of_checkpoint(cls, model_dir: str, dtype_bytes: int, world_size: int,
                      max_frames_per_push: int) -> KVSizing:
        from apbv import cost

        dims = cost.checkpoint_dims(model_dir)
        config = cost.read_config(model_dir)
        text = config.get("text_config") or config
        positions = text.get("max_position_embeddings") or config["max_position_embeddings"]
        return cls(2 * dims.layers * dims.kv_heads * dims.head_dim * dtype_bytes,
                   int(positions), world_size, max_frames_per_push)

    def tokens_per_rank(self, tokens_per_patch: int, fps: float, window_s: float | None,
                        window_tokens: int | None) -> int:
        windows = [math.ceil(self.max_positions / self.world_size)]  # the engine's ceiling
        if window_tokens is not None:
            windows.append(window_tokens)
        frames = None if window_s is None else window_s * fps  # inf past the float range
        if frames is not None and frames / 2 < self.max_positions:  # else the context bounds it
            patches = math.ceil(frames / 2) + 1
            windows.append(math.ceil(patches * tokens_per_patch / self.world_size))
        kept = min(windows)
        push = (self.max_frames_per_push + 1) // 2 * tokens_per_patch
        return kept + push

    def need(self, tokens_per_patch: int, fps: float, window_s: float | None,
             window_tokens: int | None) -> int:
        """Bytes per rank a stream reserves."""
        return self.kv_bytes_per_token * self.tokens_per_rank(tokens_per_patch, fps, window_s,
                                                               window_tokens)


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
