"""The decoder's prefill on this rank's ZigZag shard, with APB-V attention in every layer.

Legend: T local tokens, Hq/Hkv heads, D head dim. The model is stock HF; each attention layer
calls :meth:`PrefillContext.attend` (through the ``apbv`` attention implementation), which runs
:func:`apbv.attention.apbv_attention` and keeps the KV of the prompt tokens this rank owns for
the exact decode that follows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from apbv.attention import apbv_attention
from apbv.context import active
from apbv.distributed import DistInfo
from apbv.engine.kvcache import RankKVCache
from apbv.model.adapter import VideoFeatures, VideoModel
from apbv.ownership import owned_local_ranges
from apbv.plan import QUERY_RANK, Plan, Range


@dataclass
class PrefillContext:
    plan: Plan
    info: DistInfo
    overlap: bool
    kernel: str | None
    cache: RankKVCache
    owned: list[Range] = field(init=False)

    def __post_init__(self) -> None:
        self.owned = owned_local_ranges(self.plan, self.info.rank)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        self.cache.store_runs(layer, k, v, self.owned)  # slices: nothing built from host data
        return apbv_attention(q, k, v, self.plan, overlap=self.overlap, group=self.info.group,
                              softmax_scale=scale, backend=self.kernel)


@torch.inference_mode()
def prefill(
    model: VideoModel,
    inputs_embeds: torch.Tensor,
    position_ids: torch.Tensor,
    plan: Plan,
    info: DistInfo,
    *,
    overlap: bool = True,
    kernel: str | None = None,
    reserve: int = 0,
    video_features: VideoFeatures | None = None,
) -> tuple[torch.Tensor, RankKVCache]:
    """Run the decoder over the local shard.

    Args:
        inputs_embeds: (1, T, hidden) in local order; position_ids: (3, 1, T).
        plan: the layout (exact or not); info: this rank and its process group.
        overlap: the op's overlap switch; kernel: the attention kernel backend.
        reserve: cache rows to allocate for decode (on the query rank only: it alone appends).
        video_features: the shard's extra vision features for the decoder (a family with
            :attr:`~apbv.model.adapter.VideoModel.extra_levels`), else None.

    Returns:
        the logits of the last query token (vocab,) fp32 (identical on every rank: the query
        rows are exact), and this rank's KV cache.
    """
    cache = RankKVCache(model.num_layers, reserve=reserve if info.rank == QUERY_RANK else 0)
    ctx = PrefillContext(plan, info, overlap, kernel, cache)
    with active(ctx):
        hidden = model.decoder(inputs_embeds, position_ids) if video_features is None else \
            model.decoder(inputs_embeds, position_ids, video_features)
    return model.logits(hidden[0, -1]).float(), cache
