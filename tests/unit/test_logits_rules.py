"""The logits transforms and end rules of a request (:mod:`apbv.engine.logits_rules`), as
:class:`apbv.engine.sampling.Sampling` applies them: each rule's arithmetic, min_tokens'
EOS mask, and a greedy pick they change."""

from __future__ import annotations

import math

import pytest
import torch

from apbv.engine.logits_rules import NO_RULES, LogitsRules
from apbv.engine.sampling import Sampling

LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -4.0])


def test_no_rules_change_nothing_and_keep_the_captured_step():
    assert not NO_RULES.shapes_logits and Sampling().plain
    assert torch.equal(NO_RULES.apply(LOGITS, [0, 3, 3]), LOGITS)
    assert LogitsRules(ignore_eos=True).shapes_logits is False  # an end rule only
    assert not Sampling(rules=LogitsRules(min_tokens=2)).plain


def test_repetition_presence_and_frequency_penalties():
    out = LogitsRules(repetition_penalty=2.0).apply(LOGITS, [0, 1, 1])
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0, -4.0]  # positive divided, negative multiplied
    out = LogitsRules(presence_penalty=0.5, frequency_penalty=0.25).apply(LOGITS, [3, 3, 2])
    assert out.tolist() == pytest.approx([2.0, -1.0, 0.5 - 0.5 - 0.25, 3.0 - 0.5 - 0.5, -4.0])
    assert torch.equal(LogitsRules(repetition_penalty=2.0).apply(LOGITS, []), LOGITS)


def test_logit_bias_and_min_tokens():
    out = LogitsRules(logit_bias=((1, 10.0), (4, -100.0), (99, 5.0))).apply(LOGITS, [])
    assert out.tolist() == [2.0, 9.0, 0.5, 3.0, -104.0]  # id 99 is beyond this vocabulary
    rules = LogitsRules(min_tokens=2)
    assert rules.apply(LOGITS, [0], eos=[3])[3] == -math.inf  # 1 token so far: EOS masked
    assert rules.apply(LOGITS, [0, 1], eos=[3])[3] == 3.0
    assert not rules.may_end(1) and rules.may_end(2)


def test_rules_change_the_greedy_pick_and_leave_the_logits_alone():
    logits = LOGITS.clone()
    assert int(Sampling().pick(logits, 1, [3])) == 3
    assert int(Sampling(rules=LogitsRules(repetition_penalty=2.0)).pick(logits, 1, [3])) == 0
    assert int(Sampling(rules=LogitsRules(min_tokens=3)).pick(logits, 1, [0], eos=[3])) == 0
    assert int(Sampling(rules=LogitsRules(logit_bias=((4, 8.0),))).pick(logits, 0)) == 4
    assert torch.equal(logits, LOGITS)


@pytest.mark.parametrize("kwargs, text", [
    ({"repetition_penalty": 0}, "repetition_penalty must be a number in (0 .. 10]"),
    ({"repetition_penalty": 11}, "repetition_penalty must be"),
    ({"presence_penalty": -2.5}, "presence_penalty must be a number in -2 .. 2"),
    ({"frequency_penalty": math.nan}, "frequency_penalty must be"),
    ({"min_tokens": -1}, "min_tokens must be an integer >= 0"),
    ({"ignore_eos": 1}, "ignore_eos must be true or false"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias keys must be token ids >= 0"),
    ({"logit_bias": ((5, 150.0),)}, "logit_bias[5] must be a number in -100 .. 100"),
    ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "the limit is 300"),
])
def test_bad_rules_are_refused_naming_the_field_and_range(kwargs, text):
    with pytest.raises(ValueError, match=None) as info:
        LogitsRules(**kwargs)
    assert text in str(info.value), str(info.value)
