"""Per-forward state of the decoder's attention: which request, which phase, which cache.

The model's attention layers call the registered ``apbv`` attention function
(:mod:`apbv.model.common.hook`), which asks :func:`current` for the context installed around
this forward pass. A context lives for exactly one forward (``with active(ctx): ...``) and is
reset afterwards even on error; nothing survives between requests in module state.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import torch


class AttentionContext(Protocol):
    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q (1, T, Hq, D), k/v (1, T, Hkv, D) post-RoPE -> out (1, T, Hq, D)."""
        ...


_current: ContextVar[AttentionContext | None] = ContextVar("apbv_attention_context", default=None)


@contextmanager
def active(ctx: AttentionContext) -> Iterator[AttentionContext]:
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def current() -> AttentionContext:
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError(
            "the 'apbv' attention implementation runs only inside an apbv prefill or decode "
            "step; load the model for plain HF use with attn_implementation='sdpa'"
        )
    return ctx
