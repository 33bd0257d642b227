"""The grammar mask of structured output (:class:`apbv.engine.grammar.Guide`) with the trained
tiny model's real tokenizer: whatever the logits, greedy picks under the mask spell a text the
schema or regex accepts; the mask is a function of the tokens so far (two guides agree, one
guide fed another answer starts over)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

llguidance = pytest.importorskip("llguidance")
transformers = pytest.importorskip("transformers")

from apbv.engine.grammar import Guide, grammar_error  # noqa: E402
from apbv.engine.logits_rules import LogitsRules  # noqa: E402
from apbv.engine.sampling import Sampling  # noqa: E402
from apbv.openai.structured import json_grammar  # noqa: E402

ASSET = Path(__file__).resolve().parents[2] / "apbv" / "assets" / "needle-tiny"
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["magenta", "red"]},
                                           "n": {"type": "integer"}},
          "required": ["colour", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(ASSET)


def _answer(tokenizer, grammar: str, seed: int, steps: int = 60) -> str:
    """Greedy picks over random logits, masked by the grammar, until EOS."""
    sampling = Sampling(rules=LogitsRules(grammar=grammar))
    guide, tokens = Guide(grammar, tokenizer), []
    gen = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer) + 5  # a model's padded vocabulary: ids beyond are masked too
    for step in range(steps):
        token = int(sampling.pick(torch.randn(vocab, generator=gen), step, tokens, (),
                                  guide))
        if token == tokenizer.eos_token_id:
            return tokenizer.decode(tokens, skip_special_tokens=True)
        tokens.append(token)
    raise AssertionError(f"no EOS after {steps} tokens: {tokenizer.decode(tokens)!r}")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_picks_follow_a_json_schema_and_a_regex(tokenizer, seed):
    grammar = json_grammar(json.dumps(SCHEMA))
    value = json.loads(_answer(tokenizer, grammar, seed))
    assert set(value) == {"colour", "n"} and value["colour"] in ("magenta", "red"), value
    assert isinstance(value["n"], int)
    text = _answer(tokenizer, llguidance.LLMatcher.grammar_from_regex("(yes|no)-[0-9]{3}"),
                   seed)
    assert re.fullmatch("(yes|no)-[0-9]{3}", text), text


def test_the_mask_is_a_function_of_the_tokens_so_far(tokenizer):
    grammar = llguidance.LLMatcher.grammar_from_regex("ab+c")
    a, b = Guide(grammar, tokenizer), Guide(grammar, tokenizer)
    ids = tokenizer.encode("abb", add_special_tokens=False)
    logits = torch.zeros(len(tokenizer))
    first = a.mask(logits, ids)
    b.mask(logits, ids[:1])  # b has followed one token: it catches up
    assert torch.equal(first, b.mask(logits, ids))
    b.mask(logits, tokenizer.encode("abc", add_special_tokens=False))  # another answer
    assert torch.equal(first, b.mask(logits, ids))  # starts over
    assert torch.equal(a.mask(logits, []), Guide(grammar, tokenizer).mask(logits, []))
    allowed = {tokenizer.decode([i]) for i in torch.isfinite(first).nonzero().flatten().tolist()}
    assert "b" in allowed and "c" in allowed and "a" not in allowed, allowed
    assert grammar_error(llguidance.LLMatcher.grammar_from_regex("(a"), tokenizer)
