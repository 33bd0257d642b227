"""Exact greedy decode over the distributed prompt cache.

Every rank runs the whole model on the new token (hidden states are replicated). In each layer
the owning rank appends the token's KV, every rank attends the token to the KV it holds, and the
H partials are gathered and merged by log-sum-exp: exact attention over the whole prompt and the
tokens generated so far. The query rank picks the token; it is broadcast so every rank feeds the
same one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from apbv import comm
from apbv.attention import kernels
from apbv.attention.merge import merge_packed, pack_partial
from apbv.context import active
from apbv.distributed import DistInfo
from apbv.engine.kvcache import RankKVCache
from apbv.engine.request import cut_at_stop
from apbv.model.qwen2_5_vl import QwenVL
from apbv.plan import QUERY_RANK
from apbv.sequence import text_ids


@dataclass
class DecodeContext:
    """Exact attention of new rows (every rank feeds the same ones) over the distributed cache.

    The ``owner`` rank appends the rows' KV and attends them causally (bottom-right: each row
    sees every cached key and the new rows up to itself); every other rank attends them to
    all it holds, which precedes them. The H partials are merged by log-sum-exp. One decode
    token is the case of one row owned by the query rank; a stream's chunk is many rows.
    """

    info: DistInfo
    cache: RankKVCache
    kernel: str | None
    owner: int = QUERY_RANK

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        mine = self.info.rank == self.owner
        if not self.cache.holds(layer):  # a stream's rank that holds nothing yet
            self.cache.store(layer, k[:, :0], v[:, :0])
        if mine:
            self.cache.append(layer, k, v)
        keys, values = self.cache.layer(layer)
        out, lse = kernels.attention(q, keys, values, causal=mine, scale=scale,
                                     backend=self.kernel)
        gathered = comm.all_gather(pack_partial(out, lse), self.info.group)  # (H, T, Hq, D+1)
        return merge_packed(gathered)[0].to(q.dtype)


STOP = -1
"""What the query rank broadcasts instead of a token id when its ``stop`` says so: every rank
ends the decode at the same step."""


def pick_token(logits: torch.Tensor, group: dist.ProcessGroup | None,
               stop: bool = False) -> int:
    """Greedy choice on the query rank (or :data:`STOP` when ``stop`` there), broadcast to
    every rank."""
    return comm.broadcast_int(STOP if stop else int(torch.argmax(logits)), src=QUERY_RANK,
                              group=group)


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
    stop: Callable[[], bool] | None = None,
    stop_texts: Sequence[str] = (),
) -> tuple[list[int], str]:
    """The tokens from ``first_token`` on (it included) and why they ended: ``stop`` (EOS, or
    the answer's text holds one of ``stop_texts``: every rank sees the same tokens, so every
    rank ends at the same step), ``length`` (``max_new_tokens`` in total) or ``cancelled``
    (``stop()`` was true on the query rank before a step's token was picked; the other ranks'
    ``stop`` is not asked). ``on_token`` is called with each new token as soon as it is
    picked."""
    tokens = [first_token]
    eos = qwen.eos_token_ids
    tokenizer = qwen.processor.tokenizer
    ctx = DecodeContext(info, cache, kernel)

    def ended() -> str | None:
        if tokens[-1] in eos or (stop_texts and cut_at_stop(
                tokenizer.decode(tokens, skip_special_tokens=True), stop_texts)[1]):
            return "stop"
        return "length" if len(tokens) >= max_new_tokens else None

    while (reason := ended()) is None:
        logits = decode_step(qwen, tokens[-1], next_position + len(tokens) - 1, ctx)
        token = pick_token(logits, info.group,
                           stop is not None and info.rank == QUERY_RANK and stop())
        if token == STOP:
            return tokens, "cancelled"
        tokens.append(token)
        if on_token is not None:
            on_token(token)
    return tokens, reason


def choice_token_ids(tokenizer: Any, choices: Sequence[str]) -> list[list[int]]:
    """Each choice's token ids, as plain text (special-token strings are text)."""
    return [text_ids(tokenizer, choice) for choice in choices]


def score_choices(
    qwen: QwenVL,
    first_logits: torch.Tensor,
    choice_ids: list[list[int]],
    next_position: int,
    cache: RankKVCache,
    info: DistInfo,
    *,
    kernel: str | None = None,
) -> list[float]:
    """log p(choice | prompt) per choice: teacher-forced, exact, over the distributed cache.

    A choice's first token is scored by the prompt's ``first_logits``; each later token by the
    logits of a decode step fed the choice's previous token (the same exact LSE attention as
    decode; every rank runs the same steps, as they depend on the token ids only). Choices are
    visited in token order so a shared prefix is fed once: the cache is truncated back to the
    longest prefix the next choice shares, and to the prompt at the end. Single-token choices
    need no step. The values come from the query rank, so every rank returns the same ones.
    """
    first = torch.log_softmax(first_logits.float(), dim=-1)
    logprobs = [float(first[ids[0]]) for ids in choice_ids]
    scored = [1] * len(choice_ids)  # tokens counted per choice, checked at the end
    ctx = DecodeContext(info, cache, kernel)
    marks = [cache.lengths()]  # marks[j]: the cache with j choice tokens fed after the prompt
    fed: list[int] = []
    for i in sorted(range(len(choice_ids)), key=lambda i: choice_ids[i]):
        ids = choice_ids[i]
        keep = 0
        while keep < min(len(fed), len(ids) - 1) and fed[keep] == ids[keep]:
            keep += 1
        if keep < len(fed):
            cache.truncate(marks[keep])
            del fed[keep:], marks[keep + 1:]
        for token in ids[len(fed):-1]:
            logits = decode_step(qwen, token, next_position + len(fed), ctx)
            fed.append(token)
            marks.append(cache.lengths())
            row = torch.log_softmax(logits, dim=-1)
            n = len(fed)
            for m, other in enumerate(choice_ids):  # every choice continuing this prefix
                if len(other) > n and other[:n] == fed:
                    logprobs[m] += float(row[other[n]])
                    scored[m] += 1
    cache.truncate(marks[0])
    assert scored == [len(ids) for ids in choice_ids], (scored, choice_ids)
    return comm.broadcast_object(logprobs, src=QUERY_RANK, group=info.group)


def choice_table(texts: Sequence[str], choice_ids: list[list[int]],
                 logprobs: list[float]) -> list[dict[str, Any]]:
    """Per choice {"text", "tokens", "logprob", "prob"}: prob is the softmax over the choices'
    sequence log-probabilities."""
    probs = torch.softmax(torch.tensor(logprobs, dtype=torch.float64), dim=0).tolist()
    return [{"text": t, "tokens": len(ids), "logprob": lp, "prob": p}
            for t, ids, lp, p in zip(texts, choice_ids, logprobs, probs, strict=True)]


def decode_reserve(max_new_tokens: int,
                   choice_ids: list[list[int]] | None) -> tuple[int, str]:
    """(tokens decode may add after the prompt, what they are): ``max_new_tokens``, or with
    choices (``choice_ids``: :func:`choice_token_ids` of them) the longest choice's count."""
    if choice_ids is None:
        return max_new_tokens, "max_new_tokens"
    return max(map(len, choice_ids)), "the longest choice"
