"""The letter-lookup benchmark's samples: the harness's question text in the checkpoint's chat
template, then each option named with the letter of the line that names it, the loss on the
letters only."""

from __future__ import annotations

import random
import re

from transformers import AutoTokenizer

from benchmarks.letter_lookup import KINDS, copy_sample, lookup_sample


def test_each_label_is_the_letter_of_the_line_naming_the_word():
    tokenizer = AutoTokenizer.from_pretrained("apbv/assets/needle-tiny", local_files_only=True)
    rng = random.Random(0)
    kinds = set()
    for _ in range(30):
        ids, labels, kind = lookup_sample(tokenizer, rng)
        kinds.add(kind)
        assert len(ids) == len(labels)
        text = tokenizer.decode(ids)
        user, _, answer = text.partition("<|im_start|>assistant\n")
        assert "Answer with the option's letter from the given choices directly." in user
        lines = dict((word, letter) for letter, word in
                     re.findall(r"^([A-E])\. (.*)$", user, flags=re.MULTILINE))
        named = re.findall(r"^(.*) \(([A-E])\)$", answer.strip(), flags=re.MULTILINE)
        assert sorted(w for w, _ in named) == sorted(lines), (answer, lines)
        assert all(lines[word] == letter for word, letter in named), (answer, lines)
        labelled = [tokenizer.decode([i]) for i, lab in zip(ids, labels) if lab != -100]
        assert labelled == [letter for _, letter in named]
        assert all(i == lab for i, lab in zip(ids, labels) if lab != -100)
    assert kinds == set(KINDS)


def test_the_warm_up_lists_name_each_random_word_with_its_line_letter():
    tokenizer = AutoTokenizer.from_pretrained("apbv/assets/needle-tiny", local_files_only=True)
    rng = random.Random(1)
    for _ in range(30):
        ids, labels, kind = copy_sample(tokenizer, rng)
        assert kind == "copy" and len(ids) == len(labels)
        text = tokenizer.decode(ids)
        lines = dict((word, letter) for letter, word in
                     re.findall(r"^([A-H])\. (.*)$", text, flags=re.MULTILINE))
        named = re.findall(r"^(.*) \(([A-H])\)$", text, flags=re.MULTILINE)
        assert 2 <= len(lines) <= 8 and sorted(w for w, _ in named) == sorted(lines), text
        assert all(lines[word] == letter for word, letter in named), text
        labelled = [tokenizer.decode([i]) for i, lab in zip(ids, labels) if lab != -100]
        assert labelled == [letter for _, letter in named]
