"""How a request picks its tokens: greedy, or sampled with a seed; and the log-probabilities
it reports.

A :class:`Sampling` travels inside the :class:`~apbv.engine.request.Request`, so every rank
holds the same one. Sampling never draws from a shared random state: the token of step ``k``
(0: the first token) is drawn with a generator seeded from (``seed``, ``k``) alone, so a rank
that computes the same logits draws the same token, whichever rank it is and whatever ran
before, and two requests with the same seed give the same answer. The first token's logits
exist whole on the query rank only, which picks it and broadcasts it (as for greedy); every
decode step's logits are the same on every rank, which each pick the token themselves (the
decode's signal check still fails loudly on ranks that ever disagree).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from apbv.engine.logits_rules import NO_RULES, LogitsRules

if TYPE_CHECKING:
    from apbv.engine.grammar import Guide

MAX_TEMPERATURE = 2.0
"""The highest temperature accepted (OpenAI's limit)."""
MIN_TEMPERATURE = 1e-5
"""The lowest temperature above 0 accepted: below it a sampled draw is greedy in all but
rounding (vLLM treats it as greedy), and dividing float32 logits by it overflows; send 0."""
MIN_TOP_P = 1e-8
"""The lowest ``top_p`` accepted: below it only the likeliest token is ever kept (and a
float32 comparison rounds it to 0)."""
MAX_TOP_LOGPROBS = 20
"""The most alternatives per token that ``logprobs`` may ask for (OpenAI's limit)."""
MAX_SEED = 2**63 - 1
_STEP_MIX = 0x9E3779B97F4A7C15
"""Odd 64-bit constant spreading the step number over the generator's seed."""


@dataclass(frozen=True)
class Sampling:
    """Token choice of one request: temperature 0 (the default) is greedy."""

    temperature: float = 0.0
    """Logits are divided by it before the softmax; 0: greedy (argmax), 0 .. 2."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of likeliest tokens whose probability reaches it,
    in (0, 1]."""
    top_k: int = 0
    """Sample among the ``top_k`` likeliest tokens only; 0 (or -1, vLLM's spelling): all."""
    seed: int = 0
    """Seeds the draw of every step (with the step's number), 0 .. 2**63 - 1."""
    logprobs: int | None = None
    """Report each chosen token's log-probability and that many likeliest alternatives
    (0 .. 20); None: none reported."""
    rules: LogitsRules = NO_RULES
    """Logits transforms (penalties, logit_bias, min_tokens) and end rules (ignore_eos),
    applied before temperature and truncation."""

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or \
                not 0 <= t <= MAX_TEMPERATURE or 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be a number in 0 .. {MAX_TEMPERATURE:g} (0: "
                             f"greedy; else at least {MIN_TEMPERATURE:g}), got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not MIN_TOP_P <= p <= 1:
            raise ValueError(f"top_p must be a number in {MIN_TOP_P:g} .. 1, got {p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 1, or 0 or -1 for all tokens, got "
                             f"{self.top_k!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or \
                not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be an integer in 0 .. 2**63 - 1, got {self.seed!r}")
        n = self.logprobs
        if n is not None and (isinstance(n, bool) or not isinstance(n, int)
                              or not 0 <= n <= MAX_TOP_LOGPROBS):
            raise ValueError(f"top_logprobs must be an integer in 0 .. {MAX_TOP_LOGPROBS}, "
                             f"got {n!r}")
        if not isinstance(self.rules, LogitsRules):
            raise ValueError(f"rules must be LogitsRules, got {type(self.rules).__name__}")

    def for_answer(self, index: int) -> Sampling:
        """The sampling of answer ``index`` of an n > 1 request: this one for the first
        (answer 0 is the n=1 answer), else the seed moved by the answer's number."""
        if index == 0:
            return self
        return dataclasses.replace(self, seed=(self.seed + index * _STEP_MIX) % (MAX_SEED + 1))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain(self) -> bool:
        """Greedy without log-probabilities or logits transforms: what a captured decode
        step computes."""
        return self.greedy and self.logprobs is None and not self.rules.shapes_logits

    @torch.inference_mode()
    def pick(self, logits: torch.Tensor, step: int, previous: Sequence[int] = (),
             eos: Sequence[int] = (), guide: Guide | None = None) -> torch.Tensor:
        """The token of step ``step`` (0: the first) from (vocab,) ``logits``, after the
        answer's tokens ``previous`` (``eos``: the model's EOS ids; both for :attr:`rules`;
        ``guide``: the grammar's state, given exactly when ``rules.grammar`` is): a (1,) int64
        tensor on the logits' device (never read back here)."""
        assert (guide is None) == (self.rules.grammar is None), "a grammar needs its guide"
        if self.rules.shapes_logits:
            logits = self.rules.apply(logits, previous, eos)
        if guide is not None:
            logits = guide.mask(logits, previous)
        if self.greedy:
            return torch.argmax(logits).view(1)
        scaled = logits.float() / self.temperature  # finite: MIN_TEMPERATURE at least
        if self.top_k > 0 and self.top_k < scaled.numel():
            kth = torch.topk(scaled, self.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, -math.inf)
        if self.top_p < 1:
            ordered, order = torch.sort(scaled, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs  # mass of the likelier tokens
            cut = before >= self.top_p
            cut[0] = False  # the likeliest token is always kept
            ordered = ordered.masked_fill(cut, -math.inf)
            scaled = torch.full_like(scaled, -math.inf).scatter_(0, order, ordered)
        generator = torch.Generator(device=logits.device)
        generator.manual_seed((self.seed + step * _STEP_MIX) % 2**64)
        return torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator)

    @torch.inference_mode()
    def record(self, logits: torch.Tensor, token: int) -> dict[str, Any]:
        """``token``'s log-probability under the (vocab,) ``logits`` (the model's own
        distribution, before temperature and truncation, in fp32) and the ``logprobs``
        likeliest tokens': {"id", "logprob", "top": [[id, logprob], ...]}."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(logp, self.logprobs or 0) if self.logprobs else None
        return {"id": token, "logprob": float(logp[token]),
                "top": [] if top is None else
                [[int(i), float(v)] for v, i in zip(top.values.tolist(), top.indices.tolist(),
                                                    strict=True)]}


GREEDY = Sampling()


class RecordedToken(int):
    """A token id that carries its :meth:`Sampling.record` (``on_token``'s argument on the
    query rank when the request asks for logprobs: a streamed answer sends each token's
    logprobs with its text); an int everywhere else."""

    record: dict[str, Any]

    def __new__(cls, token: int, record: dict[str, Any]) -> RecordedToken:
        out = super().__new__(cls, token)
        out.record = record
        return out

    def __reduce__(self) -> tuple[Any, ...]:
        return RecordedToken, (int(self), self.record)


def reported(token: int, logprobs: list[dict] | None) -> int:
    """``token`` as ``on_token`` gets it: with its record (the last of ``logprobs``) when
    records are kept."""
    return token if not logprobs else RecordedToken(token, logprobs[-1])
