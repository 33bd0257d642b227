"""``apbv watch --watch QUESTION --choices a,b``: a standing question re-asked as the video
plays, printing an event when its answer changes (the server's rule,
:mod:`apbv.watch.rules`).

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
from apbv.validate import positive
from apbv.watch.question import StandingQuestion
from apbv.watch.rules import Rule, top_choice

if TYPE_CHECKING:
    from apbv.engine.engine import Engine


@dataclass
class StandingWatch:
    """``apbv watch --watch``'s standing question on this process's engine (checked at
    construction: ValueError): the shared :class:`~apbv.watch.question.StandingQuestion`,
    made over the stream at its first evaluation."""

    question: str
    choices: tuple[str, ...]
    rule: Rule = field(default_factory=Rule)
    every_s: float | None = None
    frames: int = 0
    asked: StandingQuestion | None = None

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
        if self.frames < 2 or (self.asked is not None and not self.asked.due(ts)):
            return
        if self.asked is None:  # its first evaluation (due: nothing seen yet)
            self.asked = StandingQuestion(
                Request(video=StreamRef(stream), question=self.question, mode=get_mode("exact"),
                        max_new_tokens=1, choices=self.choices), self.rule, self.every_s)
        asked = self.asked
        result = engine.generate(asked.request)
        if printer is None:  # the other ranks keep the clock :meth:`due` reads, alike
            asked.last_ts, asked.evaluations = ts, asked.evaluations + 1
            return
        baseline = asked.state.answer is None
        change = asked.fold(result, ts)
        probs = asked.last or {}
        shown = ", ".join(f"{c} {p:.2f}" for c, p in probs.items())
        fields = {"question": self.question, "footage_ts": ts, "probs": probs,
                  "top": top_choice(probs), "ttft_s": result.ttft_s,
                  "capture_to_event_s": time.monotonic() - taken}
        if baseline:
            printer.emit("baseline", f"[{ts:.1f} s] {self.question!r}: {asked.state.answer} "
                                     f"({shown})", answer=asked.state.answer, **fields)
        elif change is not None:
            printer.emit("watch", f"[{ts:.1f} s] {self.question!r}: {change.previous} -> "
                                  f"{change.answer} ({shown}; TTFT {result.ttft_s:.3f} s, "
                                  f"{fields['capture_to_event_s']:.2f} s after capture)",
                         **asked.event(change), ttft_s=result.ttft_s,
                         capture_to_event_s=fields["capture_to_event_s"])

    @property
    def evaluations(self) -> int:
        """Evaluations asked so far."""
        return 0 if self.asked is None else self.asked.evaluations
