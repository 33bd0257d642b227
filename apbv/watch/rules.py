"""When a standing question's answer counts as changed: the event rule of a watch (pure).

A watch asks a closed-vocabulary question again and again; each evaluation gives every choice
a probability (summing to 1). :func:`observe` folds one evaluation into the watch's
:class:`RuleState` and says whether it is an event:

- ``change``: the top choice differs from the last reported one for ``hold`` evaluations in a
  row (one noisy chunk does not alert when ``hold`` > 1).
- ``threshold``: the probability of ``choice`` rises to ``threshold`` or above (state
  ``above``), or falls below ``threshold - hysteresis`` (state ``below``), for ``hold``
  evaluations in a row; a value between the two leaves the state as it is.

The first evaluation sets the baseline (the answer, or the side of the threshold) and is no
event. The same rule serves the server's watches and ``apbv watch --watch``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from apbv.validate import integer

RULES = ("change", "threshold")
"""The event rules a watch may take."""
MAX_HOLD = 100
"""Most evaluations in a row a new answer may have to hold (``hold``)."""


@dataclass(frozen=True)
class Rule:
    """An event rule (checked at construction: ValueError naming the field and its range)."""

    kind: str = "change"
    choice: str | None = None
    """``threshold``: the choice whose probability is watched (one of the watch's choices)."""
    threshold: float = 0.5
    """``threshold``: the probability at or above which the state is ``above`` (0 < t <= 1)."""
    hysteresis: float = 0.1
    """``threshold``: the state goes back to ``below`` under ``threshold - hysteresis``
    (0 <= h < threshold)."""
    hold: int = 1
    """Evaluations in a row the new answer or state must hold before it is an event."""

    def __post_init__(self) -> None:
        if self.kind not in RULES:
            raise ValueError(f"rule must be one of {', '.join(RULES)}, got {self.kind!r}")
        integer("hold", self.hold, 1, MAX_HOLD)
        for name in ("threshold", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold!r}")
        if not 0.0 <= self.hysteresis < self.threshold:
            raise ValueError(f"hysteresis must be in [0, threshold = {self.threshold:g}), got "
                             f"{self.hysteresis!r}")
        if self.kind == "threshold" and self.choice is None:
            raise ValueError("a threshold rule names the choice it watches (choice)")
        if self.kind == "change" and self.choice is not None:
            raise ValueError("choice goes with rule 'threshold' only; rule 'change' watches "
                             "the top choice")

    def check_choices(self, choices: Sequence[str]) -> None:
        """ValueError when a threshold rule's ``choice`` is not among ``choices``."""
        if self.choice is not None and self.choice not in choices:
            raise ValueError(f"the rule's choice {self.choice[:40]!r} is not one of the "
                             f"choices {list(choices)}"[:300])


@dataclass(frozen=True)
class RuleState:
    """What a watch last reported and what is pending."""

    answer: str | None = None
    """The last reported answer (the top choice; ``threshold``: the state, ``above`` or
    ``below``); None before the first evaluation."""
    candidate: str | None = None
    """A different answer seen in the last ``streak`` evaluations, not reported yet."""
    streak: int = 0


@dataclass(frozen=True)
class Change:
    """An event: the answer went from ``previous`` to ``answer``."""

    previous: str
    answer: str


def top_choice(probs: Mapping[str, float]) -> str:
    """The most probable choice (the first of equals, in the mapping's order)."""
    return max(probs, key=lambda c: probs[c])


def observe(rule: Rule, state: RuleState, probs: Mapping[str, float]
            ) -> tuple[RuleState, Change | None]:
    """Fold one evaluation (``probs``: each choice's probability) into ``state``: the new
    state and the event it makes (None: no event)."""
    if rule.kind == "change":
        seen = top_choice(probs)
    else:
        p = probs[rule.choice]  # type: ignore[index]  # a threshold rule names its choice
        if state.answer is None:
            seen = "above" if p >= rule.threshold else "below"
        elif state.answer == "below":
            seen = "above" if p >= rule.threshold else "below"
        else:
            seen = "below" if p < rule.threshold - rule.hysteresis else "above"
    if state.answer is None:
        return RuleState(seen), None
    if seen == state.answer:
        return RuleState(state.answer), None
    streak = state.streak + 1 if seen == state.candidate else 1
    if streak < rule.hold:
        return replace(state, candidate=seen, streak=streak), None
    return RuleState(seen), Change(state.answer, seen)
