"""Exact greedy decode over the distributed prompt cache.

Every rank runs the whole model on the new token (hidden states are replicated). In each layer
the owning rank appends the token's KV, every rank attends the token to the KV it holds, and the
H partials are gathered and merged by log-sum-exp: exact attention over the whole prompt and the
tokens generated so far. The query rank picks the token; it is broadcast so every rank feeds the
same one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from apbv import comm
from apbv.attention import kernels
from apbv.attention.merge import merge_packed, pack_partial
from apbv.context import active
from apbv.distributed import DistInfo
from apbv.engine.kvcache import RankKVCache
from apbv.model.qwen2_5_vl import QwenVL
from apbv.plan import QUERY_RANK


@dataclass
class DecodeContext:
    info: DistInfo
    cache: RankKVCache
    kernel: str | None

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        if self.info.rank == QUERY_RANK:
            self.cache.append(layer, k, v)
        keys, values = self.cache.layer(layer)
        out, lse = kernels.attention(q, keys, values, causal=False, scale=scale,
                                     backend=self.kernel)
        gathered = comm.all_gather(pack_partial(out, lse), self.info.group)  # (H, 1, Hq, D+1)
        return merge_packed(gathered)[0].to(q.dtype)


def pick_token(logits: torch.Tensor, group: dist.ProcessGroup | None) -> int:
    """Greedy choice on the query rank, broadcast to every rank."""
    return comm.broadcast_int(int(torch.argmax(logits)), src=QUERY_RANK, group=group)


@torch.inference_mode()
def decode_step(
    qwen: QwenVL, token: int, position: int, ctx: DecodeContext
) -> torch.Tensor:
    """Feed one token at M-RoPE position ``position`` (all three axes); returns its logits."""
    ids = torch.tensor([[token]])
    positions = torch.full((3, 1, 1), position, dtype=torch.long)
    with active(ctx):
        hidden = qwen.decoder(qwen.embed(ids), positions)
    return qwen.logits(hidden[0, -1]).float()


def greedy_continue(
    qwen: QwenVL,
    first_token: int,
    next_position: int,
    cache: RankKVCache,
    info: DistInfo,
    *,
    max_new_tokens: int,
    kernel: str | None = None,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Tokens after ``first_token`` until EOS or ``max_new_tokens`` in total (first included);
    ``on_token`` is called with each new one as soon as it is picked."""
    tokens = [first_token]
    eos = qwen.eos_token_ids
    ctx = DecodeContext(info, cache, kernel)
    while len(tokens) < max_new_tokens and tokens[-1] not in eos:
        logits = decode_step(qwen, tokens[-1], next_position + len(tokens) - 1, ctx)
        tokens.append(pick_token(logits, info.group))
        if on_token is not None:
            on_token(tokens[-1])
    return tokens
