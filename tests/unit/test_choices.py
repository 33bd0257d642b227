"""Closed-vocabulary requests: validation, fingerprint, the cache truncation, the preflight's
reservation and the CLI (the exactness test is tests/multirank/test_choices_multirank.py)."""

from __future__ import annotations

import json

import pytest
import torch

from apbv.__main__ import main
from apbv.config import RuntimeConfig
from apbv.distributed import DistInfo
from apbv.engine import engine as engine_module
from apbv.engine.decode import choice_token_ids
from apbv.engine.engine import Engine
from apbv.engine.kvcache import RankKVCache
from apbv.engine.request import Request


def _request(choices) -> Request:
    from apbv.config import load_config

    cfg = load_config("tiny_cpu", [])
    return Request.from_config(cfg, "v.mp4", "What is shown?", choices=choices)


@pytest.mark.parametrize("choices, message", [
    (["yes"], "choices must hold 2 .. 64 choices, got 1"),
    ([], "choices must hold 2 .. 64 choices, got 0"),
    ([f"c{i}" for i in range(65)], "choices must hold 2 .. 64 choices, got 65"),
    (["yes", "no", "yes"], "choice 2 ('yes') duplicates choice 0; the choices must be distinct"),
    (["yes", ""], "choice 1 is empty; each choice must be a string of 1 .. 256 characters"),
    (["yes", "x" * 257],
     "choice 1 is 257 characters long; each choice must be a string of 1 .. 256 characters"),
    (["yes", 3], "choice 1 is int; each choice must be a string of 1 .. 256 characters"),
    ("yes", "choices must be a sequence of 2 .. 64 strings, got str"),
])
def test_bad_choices_are_refused_naming_the_problem(choices, message) -> None:
    with pytest.raises(ValueError) as info:
        _request(choices)
    assert str(info.value) == message


def test_choices_are_a_tuple_in_the_fingerprint() -> None:
    request = _request(["yes", "no", "x" * 256] + [f"c{i}" for i in range(61)])  # 64, longest ok
    assert isinstance(request.choices, tuple) and len(request.choices) == 64
    a, b = _request(["yes", "no"]).fingerprint(), _request(["no", "yes"]).fingerprint()
    assert a["choices"] == "('yes', 'no')" and a["choices"] != b["choices"]
    assert _request(None).fingerprint()["choices"] == "None"


def test_cache_truncate_returns_to_a_mark() -> None:
    cache = RankKVCache(2, reserve=2)
    k = torch.randn(1, 5, 2, 4)
    for layer in range(2):
        cache.store(layer, k, k + 1)
    mark = cache.lengths()
    for step in range(4):  # past the reservation: the buffers grow
        for layer in range(2):
            cache.append(layer, torch.full((1, 1, 2, 4), float(step)), torch.zeros(1, 1, 2, 4))
    assert cache.lengths() == (9, 9)
    cache.truncate(mark)
    assert cache.lengths() == mark == (5, 5)
    keys, values = cache.layer(1)
    assert torch.equal(keys, k) and torch.equal(values, k + 1)
    cache.append(0, torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4))
    assert torch.equal(cache.layer(0)[0][:, 5], torch.ones(1, 2, 4))


def test_preflight_reserves_the_longest_choice(tiny_config: RuntimeConfig,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(tiny_config, DistInfo(0, 1, 0, torch.device("cpu"), None))
    request = engine.request("v.mp4", "What is shown?", max_new_tokens=1,
                             choices=("yes", "<|im_end|>"))  # 1 and 6 tokens
    seen = []
    real = engine_module.request_memory
    monkeypatch.setattr(engine_module, "request_memory",
                        lambda *a, **kw: seen.append(kw["reserve_tokens"]) or real(*a, **kw))
    ids = choice_token_ids(engine.model.processor.tokenizer, request.choices)
    engine.check_fits(request, 500, 20, (0, 2), (28, 28), choice_ids=ids)
    assert seen == [6]
    limit = engine.model.max_positions
    with pytest.raises(ValueError, match=r"plus the longest choice \(6\) is"):
        engine.check_fits(request, limit - 25, 20, (0, 2), (28, 28), choice_ids=ids)
    engine.check_fits(engine.request("v.mp4", "q", max_new_tokens=1), limit - 25, 20, (0, 2),
                      (28, 28), choice_ids=None)  # the same prompt fits with one new token


def test_generate_with_choices_json(capsys, tiny_model_dir, short_video) -> None:
    args = ["generate", "--config", "tiny_cpu", "--model", str(tiny_model_dir), "--video",
            str(short_video), "--question", "What is shown?", "--mode", "exact",
            "--choices", "yes", "--choices", "no", "--choices", "red square", "--json"]
    assert main(args) == 0
    captured = capsys.readouterr()  # --json: the JSON alone on stdout, the report on stderr
    out, report = captured.out, captured.err
    result = json.loads(out.strip().splitlines()[-1])
    table = result["choices"]
    assert [(c["text"], c["tokens"]) for c in table] == [("yes", 1), ("no", 1),
                                                         ("red square", 2)]
    assert sum(c["prob"] for c in table) == pytest.approx(1.0, abs=1e-12)
    assert all(c["logprob"] < 0 for c in table)
    best = max(table, key=lambda c: c["prob"])
    assert result["answer"] == best["text"] and len(result["token_ids"]) == best["tokens"]
    for c in table:
        assert f"choice {c['text']!r}: p={c['prob']:.4f}" in report
    assert main(args[:-7] + ["--choices", "yes"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: choices must hold 2 .. 64 choices, got 1"]


def test_single_token_choices_need_no_decode_stage(tiny_config: RuntimeConfig,
                                                    short_video) -> None:
    """Probabilities sum to 1, the argmax is the greedy first token (included among the
    choices), and no decode stage runs: the answer is ready with the first token."""
    engine = Engine(tiny_config, DistInfo(0, 1, 0, torch.device("cpu"), None))
    greedy = engine.generate(engine.request(str(short_video), "What is shown?",
                                            mode="exact", max_new_tokens=1))
    tokenizer = engine.model.processor.tokenizer
    first = tokenizer.decode(greedy.token_ids)
    others = [w for w in ("yes", "no", "red", "blue") if w != first][:3]
    choices = (*others, first)
    assert all(len(tokenizer(c, add_special_tokens=False)["input_ids"]) == 1 for c in choices)
    result = engine.generate(engine.request(str(short_video), "What is shown?", mode="exact",
                                            max_new_tokens=1, choices=choices))
    assert "decode" not in result.seconds, result.seconds
    probs = [c["prob"] for c in result.choices]
    assert abs(sum(probs) - 1.0) <= 1e-9, f"sum of probabilities {sum(probs)!r}"
    assert result.answer == first and result.token_ids == greedy.token_ids, (result.answer, first)
