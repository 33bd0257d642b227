"""The event rule of a standing question (:mod:`apbv.watch.rules`), without a server:
the baseline is no event, a change of the top choice, the minimum hold, the threshold with
hysteresis, and bad rules refused with the field and its range named."""

from __future__ import annotations

import pytest

from apbv.watch.rules import Change, Rule, RuleState, observe

CHOICES = ("yes", "no")


def _run(rule: Rule, series: list[float]) -> list[tuple[int, Change]]:
    """Events of ``rule`` over evaluations giving "yes" the probabilities ``series``."""
    state, events = RuleState(), []
    for i, p in enumerate(series):
        state, change = observe(rule, state, {"yes": p, "no": 1.0 - p})
        if change is not None:
            events.append((i, change))
    return events


def test_the_first_evaluation_is_the_baseline_not_an_event():
    assert _run(Rule(), [0.9]) == []
    assert _run(Rule("threshold", choice="yes"), [0.9]) == []


def test_a_change_of_the_top_choice_is_one_event_each_way():
    assert _run(Rule(), [0.1, 0.2, 0.9, 0.95, 0.3]) == [
        (2, Change("no", "yes")), (4, Change("yes", "no"))]


def test_min_hold_ignores_one_noisy_evaluation():
    rule = Rule(hold=2)
    assert _run(rule, [0.1, 0.9, 0.1, 0.1, 0.1]) == []  # one chunk of "yes": no alert
    assert _run(rule, [0.1, 0.9, 0.9, 0.9]) == [(2, Change("no", "yes"))]
    # the streak restarts when the candidate is interrupted
    assert _run(Rule(hold=3), [0.1, 0.9, 0.9, 0.1, 0.9, 0.9, 0.9]) == [(6, Change("no", "yes"))]


def test_threshold_with_hysteresis_does_not_chatter():
    rule = Rule("threshold", choice="yes", threshold=0.7, hysteresis=0.2)
    # 0.72 crosses up; 0.6 and 0.55 stay inside the band (>= 0.5): no event; 0.4 falls below
    assert _run(rule, [0.1, 0.72, 0.6, 0.71, 0.55, 0.4, 0.69, 0.7]) == [
        (1, Change("below", "above")), (5, Change("above", "below")),
        (7, Change("below", "above"))]
    # without hysteresis the same series alerts at every wobble across 0.7
    assert len(_run(Rule("threshold", choice="yes", threshold=0.7, hysteresis=0.0),
                    [0.1, 0.72, 0.6, 0.71, 0.55])) == 4


def test_threshold_with_hold():
    rule = Rule("threshold", choice="yes", threshold=0.5, hysteresis=0.1, hold=2)
    assert _run(rule, [0.0, 0.9, 0.0, 0.9, 0.9, 0.45, 0.3, 0.2]) == [
        (4, Change("below", "above")), (7, Change("above", "below"))]


@pytest.mark.parametrize("fields, text", [
    ({"kind": "edge"}, "rule must be one of change, threshold, got 'edge'"),
    ({"hold": 0}, "hold must be an integer in 1 .. 100, got 0"),
    ({"kind": "threshold", "choice": "yes", "threshold": 1.5}, "threshold must be in (0, 1]"),
    ({"kind": "threshold", "choice": "yes", "threshold": 0.5, "hysteresis": 0.5},
     "hysteresis must be in [0, threshold = 0.5)"),
    ({"kind": "threshold"}, "a threshold rule names the choice it watches"),
    ({"choice": "yes"}, "choice goes with rule 'threshold' only"),
    ({"threshold": float("nan")}, "threshold must be a finite number"),
])
def test_bad_rules_are_refused(fields, text):
    with pytest.raises(ValueError, match=None) as info:
        Rule(**fields)
    assert text in str(info.value)


def test_a_threshold_choice_must_be_one_of_the_choices():
    Rule("threshold", choice="yes").check_choices(CHOICES)
    with pytest.raises(ValueError, match="the rule's choice 'maybe' is not one of the choices"):
        Rule("threshold", choice="maybe").check_choices(CHOICES)


def test_a_question_over_no_new_tokens_reuses_its_answer_and_its_hold_still_counts():
    from types import SimpleNamespace

    from apbv.watch.question import StandingQuestion

    def result(yes: float) -> SimpleNamespace:
        return SimpleNamespace(choices=[{"text": "yes", "prob": yes},
                                        {"text": "no", "prob": 1.0 - yes}])

    asked = StandingQuestion(SimpleNamespace(question="q"), Rule(hold=2))  # type: ignore[arg-type]
    assert not asked.reuses(0)  # never asked: nothing to reuse
    assert asked.fold(result(0.9), 1.0, tokens=10) is None  # the baseline
    assert asked.reuses(10) and not asked.reuses(12)
    assert asked.fold(result(0.1), 2.0, tokens=12) is None  # "no" once: the hold wants 2
    assert asked.reuses(12)
    change = asked.reuse(3.0)  # the same tokens: "no" again, from the reused answer
    assert change == Change(previous="yes", answer="no"), change
    assert (asked.evaluations, asked.reused, asked.events, asked.last_ts) == (3, 1, 1, 3.0)
    assert asked.asked_share == pytest.approx(2 / 3) and asked.last == {"yes": 0.1, "no": 0.9}
    cli = StandingQuestion(SimpleNamespace(question="q"))  # type: ignore[arg-type]
    cli.fold(result(0.5), 1.0)  # tokens not counted: never reused
    assert not cli.reuses(0) and cli.seen_tokens is None
