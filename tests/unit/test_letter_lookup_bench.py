"""The letter-lookup benchmark's samples: the harness's question text in the checkpoint's chat
template, then each option named with the letter of the line that names it, the loss on the
letters only."""

from __future__ import annotations

import random
import re

from transformers import AutoTokenizer

from apbv.synthetic.lookup import KINDS, copy_sample, lookup_batch, lookup_sample


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


def test_a_lookup_batch_is_text_only_and_pads_after_each_sample():
    import torch

    tokenizer = AutoTokenizer.from_pretrained("apbv/assets/needle-tiny", local_files_only=True)
    batch = lookup_batch(tokenizer, random.Random(2), 5, pad=0)
    again = [lookup_sample(tokenizer, r) for r in [random.Random(2)] for _ in range(5)]
    assert batch.pixels is None and batch.grid is None and batch.prompt_len == -1
    width = max(len(ids) for ids, _, _ in again)
    assert batch.input_ids.shape == batch.labels.shape == (5, width)
    assert batch.positions.shape == (3, 5, width)
    assert torch.equal(batch.positions[1, 3], torch.arange(width))
    for row, (ids, labels, _) in enumerate(again):
        assert batch.input_ids[row, :len(ids)].tolist() == ids
        assert batch.labels[row].tolist() == labels + [-100] * (width - len(ids))
        assert set(batch.input_ids[row, len(ids):].tolist()) <= {0}
