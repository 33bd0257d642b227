"""The vision cache's default size in ``serve``: on unless ``--vision-cache-gb`` says otherwise.

A rank's free memory after the model and after the largest request the limits admit (its peak
by :func:`apbv.cost.request_memory`: the model's weights included) is what the cache may use;
the default takes :data:`FREE_SHARE` of it, at most :data:`MAX_DEFAULT_GB`. The free memory is
the host's available memory shared by the ranks on it (CPU ranks), or the GPU's free memory
(GPU ranks, where this process sees the GPU; else the cache stays off, with the reason).
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from apbv.config import RuntimeConfig
    from apbv.openai.policy import Limits

FREE_SHARE = 0.25
"""The share of a rank's spare memory the default vision cache takes."""
MAX_DEFAULT_GB = 8.0
"""The largest default vision cache per rank, in GiB."""
QUERY_TOKENS = 64
"""Query tokens assumed for the largest admitted request (its context takes the rest)."""


def default_vision_gb(cfg: RuntimeConfig, limits: Limits, world_size: int, ranks_on_host: int,
                      use_gpu: bool) -> tuple[float, str]:
    """(GiB per rank, the sentence that says how it was chosen) for ``cfg``'s model under
    ``limits`` (:class:`apbv.openai.policy.Limits`) on ``world_size`` ranks per replica."""
    from apbv.engine.engine import _available_host_bytes

    if use_gpu:
        import torch

        if not torch.cuda.is_available():
            return 0.0, ("vision cache off: the ranks' GPUs are not visible here to size it "
                         "(--vision-cache-gb sets it)")
        free, where = torch.cuda.mem_get_info()[0], "the GPU's free memory"
    else:
        free = _available_host_bytes() // max(1, ranks_on_host)
        where = f"this host's available memory / {ranks_on_host} ranks"
    largest = largest_request_bytes(cfg, limits, world_size, use_gpu)
    spare = free - largest
    gb = max(0.0, min(MAX_DEFAULT_GB, FREE_SHARE * spare / 2**30))
    gb = math.floor(gb * 100) / 100
    return gb, (f"vision cache {gb:.2f} GiB per rank by default ({FREE_SHARE:.0%} of "
                f"{max(spare, 0) / 2**30:.2f} GiB spare: {where} {free / 2**30:.2f} GiB less "
                f"{largest / 2**30:.2f} GiB for the model and the largest admitted request; "
                f"at most {MAX_DEFAULT_GB:g} GiB; --vision-cache-gb sets it, 0 turns it off)")


def largest_request_bytes(cfg: RuntimeConfig, limits: Limits, world_size: int,
                          use_gpu: bool) -> int:
    """The peak bytes of the heaviest rank for the largest request ``limits`` admit
    (``max_prompt_tokens``, ``max_frames``, ``max_pixels_per_frame``, ``max_tokens``), the
    model's weights included (in ``model.dtype``; ``auto``: bf16 on GPUs, fp32 on CPUs)."""
    from apbv import cost
    from apbv.modes import get_mode

    dims = cost.checkpoint_dims(cfg.model.path)
    side = dims.patch_size * dims.spatial_merge_size  # a merged token's pixels (28, 32)
    cells = max(1, int(limits.max_pixels_per_frame // side**2))
    gh = max(1, int(math.isqrt(cells))) * dims.spatial_merge_size
    gw = max(1, cells // (gh // dims.spatial_merge_size)) * dims.spatial_merge_size
    query = min(QUERY_TOKENS, limits.max_prompt_tokens // 2)
    att = cfg.attention
    mode = get_mode(att.mode)
    plan = mode.plan(limits.max_prompt_tokens - query, query, world_size,
                     anchor_len=att.anchor_len, passing_len=att.passing_len)
    patches = -(-limits.max_frames // (dims.temporal_patch_size * world_size))
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else \
        "bfloat16" if use_gpu else "float32"
    dtype_bytes = {"float32": 4, "float64": 8}.get(dtype, 2)
    return max(cost.request_memory(dims, plan, patches=patches, grid_hw=(gh, gw),
                                   dtype_bytes=dtype_bytes, reserve_tokens=limits.max_tokens,
                                   rank=rank).total
               for rank in range(world_size))


def ranks_on_this_host(world_size: int, replicas: int) -> int:
    """The ranks that share this host's memory (all of them on a local cluster)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size * replicas))
