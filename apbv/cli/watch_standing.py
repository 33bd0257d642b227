"""``apbv watch --watch QUESTION --choices a,b``: a standing question re-asked as the video
plays, printing an event when its answer changes (the server's rule,
:mod:`apbv.serve.watch_rules`).

After every appended batch of frames (or once every ``every_s`` seconds of video) every rank
asks the question over the stream's held KV, alike (mode ``exact``, closed vocabulary); rank 0
folds the choices' probabilities into the rule and prints an event when it says so. The first
evaluation is the baseline (printed as ``baseline``, no event).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from apbv.modes import get_mode
from apbv.serve.watch_rules import Rule, RuleState, observe, top_choice
from apbv.validate import positive

if TYPE_CHECKING:
    from apbv.engine.engine import Engine


def parse_choices(text: str) -> tuple[str, ...]:
    """``a,b,c`` as ("a", "b", "c") (spaces around each trimmed); ValueError when empty."""
    choices = tuple(c.strip() for c in text.split(","))
    if not all(choices):
        raise ValueError(f"--choices must be a comma-separated list of non-empty choices, got "
                         f"{text[:200]!r}")
    return choices


@dataclass
class StandingQuestion:
    """One standing question and its rule's state (checked at construction: ValueError)."""

    question: str
    choices: tuple[str, ...]
    rule: Rule = field(default_factory=Rule)
    every_s: float | None = None
    state: RuleState = field(default_factory=RuleState)
    last_ts: float | None = None
    frames: int = 0
    evaluations: int = 0
    events: int = 0

    def __post_init__(self) -> None:
        from apbv.engine.request import check_choices

        if not isinstance(self.question, str) or not self.question.strip():
            raise ValueError("--watch must be a non-empty question")
        self.choices = check_choices(self.choices)
        self.rule.check_choices(self.choices)
        if self.every_s is not None:
            positive("watch_every", self.every_s)

    def after_append(self, engine: Engine, stream: str, stamps: list[float], taken: float,
                     printer: Any | None) -> None:
        """Frames at ``stamps`` were appended (taken from the capture at ``taken``, rank 0's
        monotonic clock): ask again when due (on every rank alike); ``printer`` (rank 0)
        prints the baseline and the events."""
        from apbv.engine.request import Request, StreamRef

        self.frames += len(stamps)
        ts = stamps[-1]
        if self.frames < 2 or (self.every_s is not None and self.last_ts is not None
                               and ts - self.last_ts < self.every_s):
            return
        result = engine.generate(Request(video=StreamRef(stream), question=self.question,
                                         mode=get_mode("exact"), max_new_tokens=1,
                                         choices=self.choices))
        self.last_ts, self.evaluations = ts, self.evaluations + 1
        if printer is None:
            return
        assert result.choices is not None  # a closed-vocabulary request answers with them
        probs = {c["text"]: float(c["prob"]) for c in result.choices}
        baseline = self.state.answer is None
        self.state, change = observe(self.rule, self.state, probs)
        shown = ", ".join(f"{c} {p:.2f}" for c, p in probs.items())
        fields = {"question": self.question, "footage_ts": ts, "probs": probs,
                  "top": top_choice(probs), "ttft_s": result.ttft_s,
                  "capture_to_event_s": time.monotonic() - taken}
        if baseline:
            printer.emit("baseline", f"[{ts:.1f} s] {self.question!r}: {self.state.answer} "
                                     f"({shown})", answer=self.state.answer, **fields)
        elif change is not None:
            self.events += 1
            printer.emit("watch", f"[{ts:.1f} s] {self.question!r}: {change.previous} -> "
                                  f"{change.answer} ({shown}; TTFT {result.ttft_s:.3f} s, "
                                  f"{fields['capture_to_event_s']:.2f} s after capture)",
                         answer=change.answer, previous=change.previous, **fields)
