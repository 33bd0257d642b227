"""A standing question: a closed-vocabulary ask over a live stream, re-asked as footage
arrives, whose answers are folded into a rule (:mod:`apbv.watch.rules`) that says when they
changed. The server's watches (:class:`apbv.serve.watches.state.Watch`) and ``apbv watch
--watch`` (:mod:`apbv.cli.watch_standing`) both hold one: when it is due, how an evaluation's
result is folded into a change, and the fields every event of it carries, live here once.

So does the reuse rule: a question whose stream gained no tokens since its last evaluation was
asked (temporal pruning kept none of the new patches: the held KV is the one it was asked
over) is not asked again (:meth:`StandingQuestion.reuses`); that evaluation's answer is folded
in once more (:meth:`StandingQuestion.reuse`), so time passes for its rule (a ``hold`` of N
evaluations still completes over a static scene).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from apbv.watch.rules import Change, Rule, RuleState, observe, top_choice

if TYPE_CHECKING:
    from apbv.engine.request import Request, Result

RECENT_ROUNDS = 16
"""Evaluations a question's share of asked (not reused) ones is taken over."""


def parse_choices(text: str) -> tuple[str, ...]:
    """``a,b,c`` as ("a", "b", "c") (spaces around each trimmed); ValueError when empty."""
    choices = tuple(c.strip() for c in text.split(","))
    if not all(choices):
        raise ValueError(f"--choices must be a comma-separated list of non-empty choices, got "
                         f"{text[:200]!r}")
    return choices


def probabilities(result: Result) -> dict[str, float]:
    """The choices' probabilities of a closed-vocabulary answer, by choice text."""
    return {c["text"]: float(c["prob"]) for c in result.choices or ()}


@dataclass(eq=False)
class StandingQuestion:
    """``request`` (its question and choices, asked in mode ``exact`` over the stream) asked
    again when :meth:`due`: on every new state of the stream, or at most once per ``every_s``
    seconds of footage; its rule, the rule's state and what its last evaluation saw."""

    request: Request
    rule: Rule = field(default_factory=Rule)
    every_s: float | None = None
    state: RuleState = field(default_factory=RuleState)
    evaluations: int = 0
    events: int = 0
    last_ts: float | None = None
    """Footage timestamp of the last frame its last evaluation saw (seconds)."""
    last: dict[str, float] | None = None
    """Its last evaluation's probabilities."""
    seen_tokens: int | None = None
    """The tokens its stream's chunks had added when its last evaluation was asked (None:
    never asked, or the asker does not count them)."""
    reused: int = 0
    """Evaluations answered by the previous one (the stream gained no tokens since)."""
    asked: deque[bool] = field(default_factory=lambda: deque(maxlen=RECENT_ROUNDS))
    """Per recent evaluation, whether it was asked (False: reused)."""

    def due(self, footage_ts: float) -> bool:
        """Whether the state whose last frame is at ``footage_ts`` is to be evaluated (never
        twice the same state)."""
        if self.last_ts is None:
            return True
        return footage_ts != self.last_ts if self.every_s is None else \
            footage_ts - self.last_ts >= self.every_s

    def reuses(self, tokens: int) -> bool:
        """Whether an evaluation over a stream whose chunks have added ``tokens`` tokens since
        it opened is answered by the last one (it was asked over the same tokens)."""
        return self.last is not None and self.seen_tokens == tokens

    def fold(self, result: Result, footage_ts: float,
             tokens: int | None = None) -> Change | None:
        """Fold an evaluation's ``result`` (of the state whose last frame is at
        ``footage_ts``; asked when the stream's chunks had added ``tokens`` tokens, None: not
        counted) into the rule: the change when the rule says the answer changed (the first
        evaluation is the baseline: never a change)."""
        self.seen_tokens = tokens
        self.asked.append(True)
        return self._observe(probabilities(result), footage_ts)

    def reuse(self, footage_ts: float) -> Change | None:
        """Fold the last evaluation's answer in again, for the state whose last frame is at
        ``footage_ts`` (:meth:`reuses` said it holds no new token): as :meth:`fold`."""
        assert self.last is not None, "reuse before any evaluation"
        self.reused += 1
        self.asked.append(False)
        return self._observe(self.last, footage_ts)

    @property
    def asked_share(self) -> float:
        """The share of its recent evaluations that were asked, not reused (1 before any)."""
        return sum(self.asked) / len(self.asked) if self.asked else 1.0

    def _observe(self, probs: dict[str, float], footage_ts: float) -> Change | None:
        self.evaluations += 1
        self.last, self.last_ts = probs, footage_ts
        self.state, change = observe(self.rule, self.state, probs)
        if change is not None:
            self.events += 1
        return change

    def event(self, change: Change) -> dict[str, object]:
        """The fields every event of ``change`` carries (the question, the answers, the
        probabilities of the evaluation that made it, its footage timestamp)."""
        probs = self.last or {}
        return {"question": self.request.question, "answer": change.answer,
                "previous": change.previous, "top": top_choice(probs), "probs": probs,
                "footage_ts": self.last_ts}
