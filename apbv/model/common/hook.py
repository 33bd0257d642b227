"""The attention functions apbv registers with transformers.

No modeling file is forked. The decoder's attention is routed through transformers' attention
registry: the text model runs with ``attn_implementation="apbv"``, whose function hands the
post-RoPE q/k/v of each layer to the :class:`apbv.context.AttentionContext` installed around the
forward (prefill: APB-V attention; decode: exact attention over the distributed cache). The
vision tower's grouped attention (:mod:`apbv.model.common.vision_attention`) is registered under
:data:`VISION_ATTN_IMPLEMENTATION`. Every family's decoder uses the same hook: an adapter loads
its text model with ``attn_implementation`` :data:`ATTN_IMPLEMENTATION`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface

from apbv.context import current
from apbv.model.common.vision_attention import hf_vision_attention

ATTN_IMPLEMENTATION = "apbv"
VISION_ATTN_IMPLEMENTATION = "apbv_vision_flash"
"""The grouped vision attention's registry name ("flash": see
:mod:`apbv.model.common.hf_compat`)."""


def hf_attention(
    module: Any,  # transformers' attention module (its layer_idx: an int)
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q/k/v (B, heads, T, D) -> out (B, T, Hq, D).

    HF builds no mask for an implementation it does not know, so ``attention_mask`` is None;
    the masks are structural (the plan) and never derived from positions.
    """
    assert attention_mask is None, "apbv attention takes no explicit mask"
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = current().attend(
        module.layer_idx, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale
    )
    return out, None


def register_attention() -> None:
    """Make the ``apbv`` decoder and vision attentions known to transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, hf_attention)
    AttentionInterface.register(VISION_ATTN_IMPLEMENTATION, hf_vision_attention)
