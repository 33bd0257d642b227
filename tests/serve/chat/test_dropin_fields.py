"""The real server (2 CPU rank actors, the trained tiny model answering "magenta") driven with
the official openai client for the fields a vLLM user expects to change the answer:
``ignore_eos`` runs to ``max_tokens``, ``min_tokens`` holds back EOS and stop texts,
``repetition_penalty`` and ``logit_bias`` change a greedy answer (every rank agreeing, or the
request would fail), ``n=2`` decodes two answers from one prefill, logprobs come with each
streamed delta, ``response_format`` (json_object, json_schema) and a regex give text that
parses and validates, and every field docs/compatibility.md marks "400" is a 400 naming it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from apbv.openai.chat_fields import FIELDS, UNSUPPORTED  # noqa: E402
from tests.serve.server import serving  # noqa: E402

KEY = "fields-key"
MODEL = "needle-tiny"
NEEDLE_TINY = Path(__file__).resolve().parents[3] / "apbv" / "assets" / "needle-tiny"


@pytest.fixture(scope="module")
def ask(tmp_path_factory: pytest.TempPathFactory):
    """Asks the served needle-tiny model what colour the flash of a magenta needle video is."""
    from apbv.synthetic.needle_video import write_needle_video

    media = tmp_path_factory.mktemp("fields-media")
    write_needle_video(media / "needle.mp4", "magenta")
    messages = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": (media / "needle.mp4").as_uri()}},
        {"type": "text", "text": "What colour is the flash?"}]}]
    with serving(NEEDLE_TINY, "--min-pixels", "3136", "--max-pixels", "3136", "--world-size",
                 "2", "--media-root", str(media), "--api-key", KEY,
                 "--set", "parallel.timeout_s=20") as srv:
        srv.wait_ready()
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key=KEY, max_retries=0,
                               timeout=60)
        yield lambda **kw: client.chat.completions.create(model=MODEL, messages=messages, **kw)


def _ids(out) -> list[int]:
    return out.model_extra["apbv"]["token_ids"]


def test_end_rules_ignore_eos_and_min_tokens(ask):
    plain = ask(max_tokens=12)
    assert plain.choices[0].message.content == "magenta", plain
    assert plain.usage.completion_tokens < 12 and plain.choices[0].finish_reason == "stop"
    longer = ask(max_tokens=12, extra_body={"ignore_eos": True})
    assert longer.usage.completion_tokens == 12 and longer.choices[0].finish_reason == "length"
    assert _ids(longer)[:len(_ids(plain))] == _ids(plain)  # the same answer, then on past EOS

    # min_tokens: EOS is masked and a stop text waits until the answer holds that many tokens.
    at_least = ask(max_tokens=16, extra_body={"min_tokens": plain.usage.completion_tokens + 2})
    assert at_least.usage.completion_tokens >= plain.usage.completion_tokens + 2, at_least
    cut = ask(max_tokens=12, stop=["g"])
    assert cut.choices[0].message.content == "ma" and cut.usage.completion_tokens < 6, cut
    held = ask(max_tokens=12, stop=["g"], extra_body={"min_tokens": 6})
    assert held.usage.completion_tokens >= 6 and held.choices[0].message.content == "ma", held


def test_penalties_and_logit_bias_change_a_greedy_answer(ask):
    # Past EOS the tiny model repeats itself: a token comes back, so the penalty must matter.
    plain = _ids(ask(max_tokens=24, extra_body={"ignore_eos": True}))
    assert len(set(plain)) < len(plain), plain
    penalised = _ids(ask(max_tokens=24, extra_body={"ignore_eos": True,
                                                    "repetition_penalty": 5.0}))
    assert penalised != plain and len(set(penalised)) > len(set(plain)), (plain, penalised)
    assert penalised == _ids(ask(max_tokens=24, extra_body={"ignore_eos": True,
                                                            "repetition_penalty": 5.0}))
    assert _ids(ask(max_tokens=24, frequency_penalty=2.0,
                    extra_body={"ignore_eos": True})) != plain
    banned = ask(max_tokens=8, logit_bias={str(plain[0]): -100})
    assert _ids(banned)[0] != plain[0], _ids(banned)
    with pytest.raises(openai.BadRequestError) as info:
        ask(max_tokens=2, logit_bias={"99999999": 1})
    assert info.value.body["param"] == "logit_bias" and "vocabulary" in info.value.message


def test_n_answers_from_one_prefill(ask):
    one = ask(max_tokens=12, temperature=2.0, seed=7)
    two = ask(max_tokens=12, temperature=2.0, seed=7, n=2)
    assert [c.index for c in two.choices] == [0, 1], two
    assert two.choices[0].message.content == one.choices[0].message.content, (one, two)
    assert _ids(two) == _ids(one)  # the first answer is the n=1 answer
    assert two.usage.completion_tokens > one.usage.completion_tokens
    assert two.usage.prompt_tokens == one.usage.prompt_tokens  # one prefill
    greedy = ask(max_tokens=8, n=3)  # greedy: the same answer three times
    assert [c.message.content for c in greedy.choices] == ["magenta"] * 3, greedy


def test_streamed_logprobs_come_with_each_delta(ask):
    whole = ask(max_tokens=6, logprobs=True, top_logprobs=2)
    chunks = list(ask(max_tokens=6, logprobs=True, top_logprobs=2, stream=True,
                      stream_options={"include_usage": True}))
    texts = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert texts and all(c.choices[0].logprobs is not None for c in texts), chunks
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens == len(
        whole.choices[0].logprobs.content), chunks
    assert [e.token for e in entries] == [e.token for e in whole.choices[0].logprobs.content]
    assert [e.logprob for e in entries] == pytest.approx(
        [e.logprob for e in whole.choices[0].logprobs.content], abs=1e-5)


def test_structured_output_parses_and_validates(ask):
    jsonschema = pytest.importorskip("jsonschema")
    free = ask(max_tokens=8).choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(free)  # "magenta": the model alone writes no JSON
    anything = ask(max_tokens=48, response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict), anything
    schema = {"type": "object", "properties": {"colour": {"enum": ["magenta", "red", "blue"]},
                                               "sure": {"type": "boolean"}},
              "required": ["colour", "sure"], "additionalProperties": False}
    out = ask(max_tokens=48, response_format={"type": "json_schema", "json_schema": {
        "name": "flash", "schema": schema}})
    value = json.loads(out.choices[0].message.content)
    jsonschema.validate(value, schema)
    assert out.choices[0].finish_reason == "stop", out
    text = ask(max_tokens=16, extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]+"}})
    assert re.fullmatch("[0-9]{3}-[a-z]+", text.choices[0].message.content), text


@pytest.mark.parametrize("spec", [f for f in FIELDS if f.kind == UNSUPPORTED],
                         ids=lambda f: f.name)
def test_every_field_marked_400_is_a_400_naming_it(ask, spec):
    head, _, key = spec.name.partition(".")
    with pytest.raises(openai.BadRequestError) as info:
        ask(max_tokens=2, extra_body={head: {key: spec.example} if key else spec.example})
    assert info.value.body["param"] == spec.name and spec.name in info.value.message
