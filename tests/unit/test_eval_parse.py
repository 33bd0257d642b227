"""apbv.eval.parse: the answer styles the benchmarks' own scorers accept, and what is unparseable.

Decision (documented in the module): only upper-case option letters that stand alone count;
lower case is never an answer; nothing found is None (scored wrong), never a random letter.
"""

from __future__ import annotations

import pytest

from apbv.eval.parse import option_letters, parse_choice


@pytest.mark.parametrize(("response", "letter"), [
    ("A", "A"),
    ("(B)", "B"),
    ("The answer is C.", "C"),
    ("D. option text", "D"),
    ("The best answer is A", "A"),
    ("The correct option is (D) red", "D"),
    ("Best option: B", "B"),
    ("Answer: B", "B"),
    ("[C]", "C"),
    ("  B\n", "B"),
    ("B) blue", "B"),
    ("C, because the square is red", "C"),
    ("Based on the video, the answer is D.", "D"),  # "B" inside "Based" is no answer
    ("A or B", "A"),  # the first standalone letter decides, as in both benchmarks' scorers
])
def test_accepted_answer_styles(response: str, letter: str) -> None:
    assert parse_choice(response, "ABCD") == letter


@pytest.mark.parametrize("response", [
    "",
    "   ",
    "the answer is c",  # lower case is never an answer ("a" is an article)
    "red",  # the option's text without its letter
    "Based on the video it is red",
    "Esco",
    "A\u9a6c",  # a letter touching a letter of another script is inside a word
    "\u00c0\uc229esco\u9a6c\u6765\u0627\u0626\u0642",  # what the tiny random model answers
    "E",  # not one of four options
])
def test_unparseable_is_none(response: str) -> None:
    assert parse_choice(response, "ABCD") is None


def test_five_options_and_letter_validation() -> None:
    assert option_letters(4) == "ABCD" and option_letters(5) == "ABCDE"
    assert parse_choice("E. black", option_letters(5)) == "E"
    assert parse_choice("E? No: B", "ABCD") == "B"  # letters outside the options are skipped
    with pytest.raises(ValueError, match="2..5 options, got 6"):
        option_letters(6)
    with pytest.raises(ValueError, match="letters must be some of ABCDE, got 'AZ'"):
        parse_choice("A", "AZ")
