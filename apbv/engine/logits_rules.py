"""What a request changes in the logits before a token is picked, and when its answer may end:
``ignore_eos``, ``min_tokens``, ``repetition_penalty``, ``presence_penalty``,
``frequency_penalty`` and ``logit_bias`` (the OpenAI and vLLM fields of those names).

The rules are a pure function of the (vocab,) logits, the answer's tokens so far and the
model's EOS ids: the query rank applies them to the first token's logits (then broadcasts the
token, as for greedy), and every rank applies them alike to each decode step's logits, which
are the same everywhere, so every rank picks the same token. The penalties see the answer's
tokens only (not the prompt's): a video prompt is thousands of placeholder tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_PENALTY = 2.0
"""presence_penalty and frequency_penalty lie in -2 .. 2 (OpenAI's range)."""
MAX_BIAS = 100.0
"""A logit_bias value lies in -100 .. 100 (OpenAI's range)."""
MAX_BIASED = 300
"""Token ids one logit_bias may name (OpenAI's limit)."""
MAX_REPETITION_PENALTY = 10.0
"""repetition_penalty lies in (0, 10]."""


def _number(name: str, value: object, low: float, high: float, open_low: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value > high or \
            (value <= low if open_low else value < low):
        raise ValueError(f"{name} must be a number in {'(' if open_low else ''}{low:g} .. "
                         f"{high:g}{']' if open_low else ''}, got {value!r}")


@dataclass(frozen=True)
class LogitsRules:
    """A request's logits transforms and end rules (the defaults change nothing)."""

    ignore_eos: bool = False
    """EOS does not end the answer: it goes on to max_tokens."""
    min_tokens: int = 0
    """EOS is masked, and stop texts do not end the answer, until it holds this many tokens."""
    repetition_penalty: float = 1.0
    """Each token already in the answer: a positive logit divided by it, a negative one
    multiplied (vLLM's and HF's rule), in (0, 10]."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of each token already in the answer, -2 .. 2."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit per time it is in the answer, -2 .. 2."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to those logits, each bias in -100 .. 100."""
    grammar: str | None = None
    """Structured output: llguidance's serialised grammar the answer must follow
    (:class:`apbv.engine.grammar.Guide` masks each token's logits); None: free text."""

    def __post_init__(self) -> None:
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or \
                self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        _number("repetition_penalty", self.repetition_penalty, 0, MAX_REPETITION_PENALTY,
                open_low=True)
        _number("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _number("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        if len(self.logit_bias) > MAX_BIASED:
            raise ValueError(f"logit_bias names {len(self.logit_bias)} tokens; the limit is "
                             f"{MAX_BIASED}")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            _number(f"logit_bias[{token}]", bias, -MAX_BIAS, MAX_BIAS)
        if self.grammar is not None and (not isinstance(self.grammar, str) or self.min_tokens):
            raise ValueError("min_tokens does not go with structured output (the grammar may "
                             "allow nothing but EOS)" if self.min_tokens else
                             f"grammar must be a string, got {type(self.grammar).__name__}")

    @property
    def shapes_logits(self) -> bool:
        """Whether :meth:`apply` changes any logits (a captured greedy step cannot)."""
        return bool(self.min_tokens or self.repetition_penalty != 1 or self.presence_penalty
                    or self.frequency_penalty or self.logit_bias or self.grammar is not None)

    def may_end(self, produced: int) -> bool:
        """Whether an answer of ``produced`` tokens may end on EOS or a stop text."""
        return produced >= self.min_tokens

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, previous: Sequence[int],
              eos: Sequence[int] = ()) -> torch.Tensor:
        """(vocab,) fp32 logits with the rules applied, for the token that follows the
        answer's tokens ``previous`` (``eos``: the model's EOS ids, masked while the answer is
        shorter than min_tokens); ``logits`` itself is left as it is. Ids beyond the
        vocabulary are skipped (the server refuses them first)."""
        out = logits.float().clone()
        vocab = out.numel()
        if previous and (self.repetition_penalty != 1 or self.presence_penalty or
                         self.frequency_penalty):
            ids = torch.tensor([t for t in previous if 0 <= t < vocab], dtype=torch.long,
                               device=out.device)
            counts = torch.zeros_like(out).index_add_(0, ids, torch.ones_like(ids,
                                                                                dtype=out.dtype))
            seen = counts > 0
            if self.repetition_penalty != 1:
                penalised = torch.where(out > 0, out / self.repetition_penalty,
                                        out * self.repetition_penalty)
                out = torch.where(seen, penalised, out)
            out = out - self.presence_penalty * seen.float() - self.frequency_penalty * counts
        if self.logit_bias:
            pairs = [(t, b) for t, b in self.logit_bias if t < vocab]
            if pairs:
                ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=out.device)
                out.index_add_(0, ids, torch.tensor([b for _, b in pairs], dtype=out.dtype,
                                                    device=out.device))
        if len(previous) < self.min_tokens:
            masked = [t for t in eos if 0 <= t < vocab]
            if masked:
                out[torch.tensor(masked, dtype=torch.long, device=out.device)] = -math.inf
        return out


NO_RULES = LogitsRules()
