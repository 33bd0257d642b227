"""What a run shows on the terminal: a progress line per sample and the summary at the end."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, TextIO

Row = dict[str, Any]


class Progress:
    """A line per finished sample on rank 0: done/total, ETA, running accuracy. In a log (a
    stream that is no terminal) each is a plain line; on a terminal one line is rewritten in
    place (``\\r``) and ended by :meth:`close`.

    The ETA: with ``predicted`` (sample id -> the cost model's seconds for each sample to
    run, :func:`apbv.eval.forecast.predicted_seconds`), the predicted seconds left scaled by
    the measured/predicted ratio of the samples done so far (corrected as the run goes);
    without, the mean time per sample done times the samples left."""

    def __init__(self, stream: TextIO | None, total: int, rows: list[Row], compare: bool,
                 predicted: dict[str, float] | None = None):
        self.stream = stream
        self.total = total
        self.done = len(rows)
        self.correct = sum(bool(r["correct"]) for r in rows)
        self.errors = sum(r["error"] is not None for r in rows)
        self.compare = compare
        self.compared = [r["exact"]["same_letter"] for r in rows
                         if compare and r["exact"] is not None
                         and r["exact"]["same_letter"] is not None]
        self.new = 0
        self.start = time.monotonic()
        self.predicted = predicted
        self.left = sum(predicted.values()) if predicted else 0.0
        self.done_predicted = 0.0
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.open_line = False

    def eta_s(self) -> float:
        """Seconds left (see the class)."""
        elapsed = time.monotonic() - self.start
        if self.predicted and self.done_predicted > 0:
            return elapsed * max(self.left, 0.0) / self.done_predicted
        return elapsed / max(self.new, 1) * (self.total - self.done)

    def update(self, row: Row) -> None:
        self.done += 1
        self.new += 1
        if self.predicted and row["id"] in self.predicted:
            self.left -= self.predicted[row["id"]]
            self.done_predicted += self.predicted[row["id"]]
        self.correct += bool(row["correct"])
        self.errors += row["error"] is not None
        if self.compare and row["exact"] is not None and row["exact"]["same_letter"] is not None:
            self.compared.append(row["exact"]["same_letter"])
        if self.stream is None:
            return
        eta = timedelta(seconds=round(self.eta_s()))
        line = (f"[{self.done}/{self.total}] {100 * self.done / self.total:.1f}%  eta {eta}  "
                f"acc {self.correct / self.done:.3f}")
        if self.errors:
            line += f"  errors {self.errors}"
        if self.compared:
            line += f"  agree {sum(self.compared) / len(self.compared):.3f}"
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
            self.stream.flush()
            self.open_line = True
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        """End the terminal's rewritten line (nothing in a log)."""
        if self.open_line and self.stream is not None:
            print(file=self.stream, flush=True)
            self.open_line = False


def _fraction(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def summary(results: dict[str, Any]) -> str:
    """A few lines for the terminal: the headline metrics, the breakdown, the agreement."""
    details = results["apbv"]
    bench, scores = details["benchmark"], details["scores"]
    (task, table), = results["results"].items()
    metrics = "  ".join(f"{k.split(',')[0]} {_fraction(v)}" for k, v in table.items()
                        if k.endswith(",none") and "_stderr" not in k)
    lines = [(f"{task}: {metrics}  ({scores['num']} samples, {scores['errors']} failed, "
              f"{scores['unparsed']} unparsed)")]
    if bench == "longvideobench":
        for key in ("duration_group", "question_category"):
            parts = [f"{name} {_fraction(s['acc'])} ({s['num']})"
                     for name, s in scores[key].items()]
            lines.append(f"  {key}: " + ", ".join(parts))
    else:
        parts = [f"{name} {_fraction(s['acc'])} ({s['questions']})"
                 for name, s in scores["types"].items()]
        lines.append("  per type (questions with all 4 tries right): " + ", ".join(parts))
        if scores["incomplete_questions"]:
            lines.append(f"  {scores['incomplete_questions']} question(s) without all 4 tries "
                         f"run are not scored")
    if "compare_exact" in details:
        c = details["compare_exact"]
        unparsed = c["unparsed_pairs"]
        lines.append(f"  agreement with exact attention over {c['compared']} samples: letters "
                     f"{_fraction(c['letter_agreement'])} (over {c['letter_pairs']} pairs "
                     f"with both letters; {unparsed['total']} pairs unparsed: "
                     f"{unparsed['mode_unparsed']} mode only, {unparsed['exact_unparsed']} exact "
                     f"only, {unparsed['both_unparsed']} both), tokens "
                     f"{_fraction(c['token_agreement'])}")
    return "\n".join(lines)
