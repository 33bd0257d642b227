"""Text-only samples of the option-letter lookup (pure, seeded), for the letter-lookup
benchmark (``benchmarks/letter_lookup.py``) and the trainer's ``lookup`` steps.

To answer a needle question with ``green (B)`` the tiny model must find the option line that
names the word it read and copy that line's letter. A sample here is the harness's own
question text (:func:`apbv.eval.data.choice_prompt`, options drawn as
:func:`apbv.synthetic.choices.choice_options` draws them) in the checkpoint's chat template,
then an assistant turn naming every option in a random order, each followed by its letter;
the labels are the letters only (-100 elsewhere), so a sample teaches 2-5 lookups.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from apbv.eval.data import choice_prompt
from apbv.eval.parse import option_letters
from apbv.synthetic.batch import Encoded
from apbv.synthetic.choices import CHOICE_KINDS, choice_options
from apbv.synthetic.needles import QUESTIONS, answer_choices

KINDS = ("retrieval", "counting", "presence")
HELDOUT_SEED = 9_000_011
"""Seed of the held-out samples (training draws from ``--seed``)."""


def lookup_sample(tokenizer: Any, rng: random.Random) -> tuple[list[int], list[int], str]:
    """(ids, labels, kind) of one sample: -100 everywhere but the letter after each ``word (``."""
    kind = rng.choice(KINDS)
    bench = rng.choice([b for b, kinds in CHOICE_KINDS.items() if kind in kinds])
    answer = rng.choice(answer_choices(kind))
    options = choice_options(bench, kind, answer, np.random.default_rng(rng.randrange(2**32)))
    letters = option_letters(len(options))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": choice_prompt(bench, QUESTIONS[kind], options)}],
        add_generation_prompt=True, tokenize=False)
    order = list(range(len(options)))
    rng.shuffle(order)
    return (*_named(tokenizer, text, options, letters, order), kind)


def _named(tokenizer: Any, text: str, words: list[str], letters: str, order: list[int]
           ) -> tuple[list[int], list[int]]:
    """(ids, labels) of ``text`` then ``word (L)`` for each word in ``order``, each line's
    letter ``L`` labelled (logits at ``(`` predict it), every other token -100."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    labels = [-100] * len(ids)
    close = tokenizer(")\n", add_special_tokens=False)["input_ids"]
    for i in order:
        word = tokenizer(words[i] + " (", add_special_tokens=False)["input_ids"]
        (letter,) = tokenizer(letters[i], add_special_tokens=False)["input_ids"]
        ids += word + [letter] + close
        labels += [-100] * len(word) + [letter] + [-100] * len(close)
    return ids, labels


def copy_sample(tokenizer: Any, rng: random.Random) -> tuple[list[int], list[int], str]:
    """(ids, labels, "copy") of a dense warm-up sample: 2-8 lines ``L. word`` of random words
    (1-6 lowercase letters or digits), then every word named with its letter as above."""
    count = rng.randint(2, 8)
    words: list[str] = []
    while len(words) < count:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789")
                       for _ in range(rng.randint(1, 6)))
        if word not in words:
            words.append(word)
    letters = "ABCDEFGH"[:count]
    text = "".join(f"{c}. {w}\n" for c, w in zip(letters, words))
    return (*_named(tokenizer, text, words, letters, rng.sample(range(count), count)), "copy")


def lookup_batch(tokenizer: Any, rng: random.Random, count: int, pad: int) -> Encoded:
    """``count`` :func:`lookup_sample` samples padded with ``pad`` into one text-only batch
    (no video: ``pixels`` and ``grid`` None; positions 0..T-1 on every M-RoPE axis)."""
    ids, labels = pad_samples([lookup_sample(tokenizer, rng) for _ in range(count)], pad)
    positions = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, count, -1)
    return Encoded(ids, labels, positions, None, None, -1)


def pad_samples(samples: list[tuple[list[int], list[int], str]], pad: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels), each (B, T): the samples' ids padded with ``pad`` and labels with -100
    to the longest."""
    width = max(len(ids) for ids, _, _ in samples)
    return (torch.tensor([s[0] + [pad] * (width - len(s[0])) for s in samples]),
            torch.tensor([s[1] + [-100] * (width - len(s[1])) for s in samples]))
