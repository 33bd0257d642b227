"""Closed-vocabulary answers on the tiny Qwen2.5-VL, on 1 and 2 gloo ranks, in exact mode.

- each choice's log-probability equals the one from HF's own single-process forward over the
  prompt ids followed by the choice's tokens (same pixel values and M-RoPE positions; the
  choice's tokens continue at max(prompt positions) + 1 on all three axes);
- after scoring, the cache is the prompt's again: greedy decode on that same cache gives the
  tokens of a plain greedy request;
- the choice probabilities are a softmax over the choices, the answer is the likeliest, and
  every rank returns the same table;
- a ``stop`` that turns true on the query rank (rank 0 only) ends the decode on every rank at
  the same step: the plain request's first tokens, ``cancelled``;
- a stop text ends the decode on every rank once the answer holds it, and the answer is cut
  before it;
- a ``stop`` already true after preprocessing, or after the vision tower (rank 0 only), ends
  the request there on every rank with RequestCancelled.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from apbv.config import RuntimeConfig
from apbv.distributed import DistInfo, spawn_local
from apbv.engine import runner
from apbv.engine.answer import DecodeSettings
from apbv.engine.decode import greedy_continue, host_token, pick_token
from apbv.engine.engine import Engine
from apbv.engine.request import RequestCancelled
from apbv.sequence import text_ids
from tests.cases import LOGPROB_RTOL, logprob_error
from tests.hf_reference import hf_reference

QUESTION = "Which colour comes after the blue one?"
# Single-token choices (yes, no, red) and multi-token ones sharing a prefix with another
# ("red square" after "red"), and special-token text scored as plain text.
CHOICES = ("yes", "no", "red square", "red", "<|im_end|>", "blue circle")
NEW_TOKENS = 6


def _rank_job(info: DistInfo, cfg: RuntimeConfig, video: str) -> dict:
    engine = Engine(cfg, info)
    after: dict = {}
    score = runner.score_choices

    def score_then_decode(model, first_logits, ids, next_position, cache, info, **kw):
        before = cache.lengths()
        out = score(model, first_logits, ids, next_position, cache, info, **kw)
        after["lengths_equal"] = cache.lengths() == before
        first = pick_token(first_logits, info.group)  # greedy on the very same cache
        plain = engine.request(video, QUESTION, mode="exact", max_new_tokens=NEW_TOKENS)
        after["tokens"] = greedy_continue(model, first, host_token(first), next_position, cache,
                                          info, plain, DecodeSettings(**kw)).tokens
        return out

    runner.score_choices = score_then_decode
    try:
        scored = engine.generate(engine.request(video, QUESTION, mode="exact",
                                                choices=CHOICES))
    finally:
        runner.score_choices = score
    plain = engine.generate(engine.request(video, QUESTION, mode="exact",
                                           max_new_tokens=NEW_TOKENS))
    seen: list[int] = []  # a client that goes away after 3 tokens, seen by rank 0 only
    stopped = engine.generate(engine.request(video, QUESTION, mode="exact",
                                             max_new_tokens=NEW_TOKENS), on_token=seen.append,
                              stop=(lambda: len(seen) >= 3) if info.rank == 0 else None)
    # A stop text that begins where the third token's text does.
    start = len(engine.model.processor.tokenizer.decode(plain.token_ids[:2],
                                                        skip_special_tokens=True))
    stop_text = plain.answer[start:start + 2]
    cut = engine.generate(engine.request(video, QUESTION, mode="exact",
                                         max_new_tokens=NEW_TOKENS, stop_texts=stop_text))
    early, asked = [], []

    def second_time() -> bool:  # false after preprocessing, true after the vision tower
        asked.append(1)
        return len(asked) >= 2

    for stop in ((lambda: True), second_time):  # the client went away before the answer began
        try:
            engine.generate(engine.request(video, QUESTION, mode="exact", max_new_tokens=2),
                            stop=stop if info.rank == 0 else None)
        except RequestCancelled as exc:
            early.append(str(exc))
    return {"scored": scored.to_json(), "after": after, "plain": plain.token_ids, "early": early,
            "plain_finish": plain.finish_reason, "stopped": stopped.token_ids,
            "stopped_finish": stopped.finish_reason, "plain_answer": plain.answer,
            "stop_text": stop_text, "cut": cut.to_json()}


@pytest.fixture(scope="module")
def reference(tiny_config: RuntimeConfig, short_video: Path) -> dict[str, float]:
    """Per choice, log p(choice | prompt) from HF's forward (SDPA) over prompt + choice."""
    ref = hf_reference(tiny_config, str(short_video), QUESTION)
    out = {}
    for choice in CHOICES:
        tokens = torch.tensor(text_ids(ref.model.processor.tokenizer, choice))
        n = len(ref.ids)
        rows = torch.log_softmax(ref.logits(tokens.tolist())[n - 1 : n - 1 + len(tokens)], -1)
        out[choice] = float(rows.gather(1, tokens.view(-1, 1)).sum())
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_choices_match_hf_and_leave_the_prompt_cache(
    world_size: int, tiny_config: RuntimeConfig, short_video: Path, reference: dict
) -> None:
    per_rank = spawn_local(_rank_job, world_size, (tiny_config, str(short_video)),
                           timeout_s=600, collective_timeout_s=120)
    table = per_rank[0]["scored"]["choices"]
    assert [c["text"] for c in table] == list(CHOICES)
    assert [c["tokens"] for c in table] == [1, 1, 2, 1, 6, 2], table
    errors = {c["text"]: logprob_error(c["logprob"], reference[c["text"]]) for c in table}
    worst = max(errors.values())
    assert worst <= LOGPROB_RTOL, (
        f"{world_size} rank(s): choice logprobs (summed over up to 6 tokens) vs HF forward "
        f"(fp32): max relative err {worst:.2e} > {LOGPROB_RTOL:g}: {errors}")
    print(f"\n{world_size} rank(s): max relative |logprob - HF| = {worst:.2e}")
    total = sum(math.exp(c["logprob"]) for c in table)
    for c in table:
        assert c["prob"] == pytest.approx(math.exp(c["logprob"]) / total, rel=1e-9), c
    best = max(table, key=lambda c: c["logprob"])
    scored = per_rank[0]["scored"]
    assert scored["answer"] == best["text"] and len(scored["token_ids"]) == best["tokens"]
    for rank, r in enumerate(per_rank):
        assert r["scored"]["choices"] == table, f"rank {rank} returned another table"
        assert r["after"]["lengths_equal"], f"rank {rank}: the cache was not truncated back"
        assert r["after"]["tokens"] == r["plain"], (rank, r["after"]["tokens"], r["plain"])
        assert (len(r["plain"]), r["plain_finish"]) == (NEW_TOKENS, "length"), r["plain"]
        assert (r["stopped"], r["stopped_finish"]) == (r["plain"][:3], "cancelled"), rank
        cut, text = r["cut"], r["plain_answer"]
        assert r["stop_text"] and cut["finish_reason"] == "stop", (rank, cut)
        assert cut["answer"] == text[:text.find(r["stop_text"])], (rank, cut, text)
        n = len(cut["token_ids"])
        assert 3 <= n < NEW_TOKENS and cut["token_ids"] == r["plain"][:n], (rank, cut)
        assert cut == per_rank[0]["cut"], f"rank {rank} ended elsewhere"
        assert r["early"] == ["cancelled before the vision tower",
                              "cancelled before the prefill"], (rank, r["early"])
    assert len(set(per_rank[0]["plain"])) > 1, per_rank[0]["plain"]  # not a degenerate check
