"""Deterministic parsing of a multiple-choice answer: the option letter, or None.

Both benchmarks end the prompt with "Answer with the option's letter from the given choices
directly." Their own scorers read the letter like this:

- LongVideoBench (its paper's code, kept by lmms-eval's ``longvideobench`` tasks): remove
  prefixes such as "The best answer is", then take the first of A-E found *anywhere* in the
  text; when there is none, a random letter (unseeded ``random.choice``, so two scorings of one
  output can differ, and a guess can be right).
- VNBench (VideoNIAH ``evaluation/eval.py``): cut the text at its first ".", then test
  ``"A" in text``, then B, C, D, in that order (so any capital A wins, e.g. in "An apple").

:func:`parse_choice` accepts what they accept in the answer styles models actually give, without
the guess and without the letter-inside-a-word matches:

1. The answer is the first option letter of the sample (upper case, e.g. A-D for four options)
   that stands alone: no letter, digit or underscore of any script right before or after it.
   So "A", "(B)", "The answer is C.", "D. option text", "The best answer is A", "Answer: B" and
   "[C]" parse, while "Based on the video" does not give B and "Esco" does not give E.
   Answer prefixes need no removal: no prefix holds a standalone capital letter.
2. Lower-case letters are never answers ("a" is an article): "the answer is c" is unparseable.
   Neither is the option's text without its letter (neither benchmark maps text to a letter).
3. Nothing found: None. The harness scores it as wrong and counts it as unparsed; there is no
   random fallback (spava-algorithm.md B12).

A letter outside the sample's options ("E" for a four-option question) is skipped like any
other character.
"""

from __future__ import annotations

import re

OPTION_LETTERS = "ABCDE"
"""The letters the benchmarks use, in order (LongVideoBench has up to 5 options)."""


def option_letters(count: int) -> str:
    """The letters of ``count`` options: "ABCD" for 4."""
    if isinstance(count, bool) or not isinstance(count, int) or not 2 <= count <= 5:
        raise ValueError(f"a question must have 2..5 options, got {count!r}")
    return OPTION_LETTERS[:count]


def parse_choice(response: str, letters: str) -> str | None:
    """The first standalone option letter of ``response`` among ``letters``, else None."""
    if not letters or any(c not in OPTION_LETTERS for c in letters):
        raise ValueError(f"letters must be some of {OPTION_LETTERS}, got {letters!r}")
    match = re.search(rf"(?<!\w)([{letters}])(?!\w)", response)
    return match.group(1) if match else None
