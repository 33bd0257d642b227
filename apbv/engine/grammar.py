"""Structured output: a grammar (llguidance's serialised form, built from a JSON schema, a regex
or a Lark/GBNF grammar by :mod:`apbv.openai.structured`) masks the logits of each token so the
answer can only be a text the grammar accepts.

A :class:`Guide` follows the answer's tokens: :meth:`Guide.mask` first consumes the tokens of
``previous`` it has not seen (starting over when ``previous`` is not a continuation of what it
consumed), then sets the logits of every token the grammar forbids next to -inf. It is a
function of the grammar and ``previous`` alone, so the query rank masking the first token and
every rank masking each decode step's logits (the same everywhere) pick the same token, as
for greedy. The grammar engine is ``llguidance`` (HF fast tokenizers), imported on first use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

_TOKENIZERS: dict[int, Any] = {}
"""llguidance's view of each HF tokenizer (building it takes up to a second), by id()."""


def ll_tokenizer(tokenizer: Any) -> Any:
    """llguidance's LLTokenizer of the HF fast ``tokenizer`` (cached while it lives)."""
    import llguidance.hf

    key = id(tokenizer)
    held = _TOKENIZERS.get(key)
    if held is None or held[0] is not tokenizer:
        held = _TOKENIZERS[key] = (tokenizer, llguidance.hf.from_tokenizer(tokenizer))
    return held[1]


def grammar_error(grammar: str, tokenizer: Any) -> str | None:
    """Why ``grammar`` cannot guide ``tokenizer``'s tokens, or None when it can."""
    import llguidance

    matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar, log_level=0)
    return matcher.get_error() if matcher.is_error() else None


class Guide:
    """The grammar's state along one answer, on one rank."""

    def __init__(self, grammar: str, tokenizer: Any):
        import llguidance

        self.matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"the grammar is not valid: {self.matcher.get_error()[:300]}")
        self.consumed: list[int] = []

    def _follow(self, previous: Sequence[int]) -> None:
        if list(previous[:len(self.consumed)]) != self.consumed:
            self.matcher.reset()
            self.consumed = []
        for token in previous[len(self.consumed):]:
            if not self.matcher.consume_token(token):  # a token the mask forbade: a bug
                raise RuntimeError(f"the grammar refused token {token} after "
                                   f"{len(self.consumed)} tokens: "
                                   f"{self.matcher.get_error()[:200]}")
            self.consumed.append(token)

    @torch.inference_mode()
    def mask(self, logits: torch.Tensor, previous: Sequence[int]) -> torch.Tensor:
        """(vocab,) fp32 ``logits`` with the tokens the grammar forbids after ``previous`` (the
        answer's tokens so far) at -inf (a copy)."""
        self._follow(previous)
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
        bits = (words.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.flatten().bool()
        vocab = logits.numel()
        if allowed.numel() < vocab:  # ids beyond the tokenizer's: never allowed
            allowed = torch.cat([allowed, allowed.new_zeros(vocab - allowed.numel())])
        out = logits.float().clone()
        return out.masked_fill_(~allowed[:vocab].to(out.device), -math.inf)
