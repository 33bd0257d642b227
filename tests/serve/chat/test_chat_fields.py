"""The chat field table (:mod:`apbv.openai.chat_fields`), without a server: docs/compatibility.md
lists exactly its rows and classes; every row is walked through ``parse_chat`` (a 400 naming
each unsupported field unless lenient, a harmless one reported, a neutral value accepted as
absent); the acted-on fields are the typed body's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from apbv.openai.chat_body import ChatBody  # noqa: E402
from apbv.openai.chat_fields import _ABSENT, ACTED, FIELDS, IGNORED, UNSUPPORTED  # noqa: E402
from apbv.openai.policy import ClientError, Limits, MediaPolicy  # noqa: E402

DOCS = Path(__file__).resolve().parents[3] / "docs" / "compatibility.md"


@pytest.fixture
def chat(tmp_path: Path):
    from apbv.config import load_config
    from apbv.openai.chat import parse_chat

    (tmp_path / "clip.mp4").write_bytes(b"x")  # parse_chat does not open it
    cfg = load_config("tiny_cpu")
    policy = MediaPolicy((str(tmp_path),))

    def parse(lenient: bool = False, **fields):
        messages = [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": (tmp_path / "clip.mp4").as_uri()}},
            {"type": "text", "text": "what?"}]}]
        return parse_chat({"messages": messages, **fields}, cfg, Limits(), policy, "m", lenient)
    return parse


def _body(name: str, value: object) -> dict:
    head, _, key = name.partition(".")
    return {head: {key: value}} if key else {head: value}


def test_the_docs_table_is_the_code_table():
    rows = re.findall(r"^\| `([a-z_.]+)` \| (\w+) \| ([a-z0-9 ]+) \|", DOCS.read_text(), re.M)
    assert rows == [(f.name, f.origin, f.kind) for f in FIELDS], "docs/compatibility.md differs"
    assert {f.kind for f in FIELDS} == {ACTED, IGNORED, UNSUPPORTED}


@pytest.mark.parametrize("spec", [f for f in FIELDS if f.kind == UNSUPPORTED],
                         ids=lambda f: f.name)
def test_each_unsupported_field_is_a_400_naming_it_unless_lenient(chat, spec):
    with pytest.raises(ClientError) as info:
        chat(**_body(spec.name, spec.example))
    assert info.value.status == 400 and info.value.param == spec.name, info.value.message
    assert spec.name in info.value.message and "not supported" in info.value.message
    assert chat(lenient=True, **_body(spec.name, spec.example)).ignored == (spec.name,)
    assert chat(**_body(spec.name, None)).ignored == ()  # null: as if absent
    if spec.neutral is not _ABSENT:  # its neutral value changes nothing: accepted
        assert chat(**_body(spec.name, spec.neutral)).ignored == ()


@pytest.mark.parametrize("spec", [f for f in FIELDS if f.kind == IGNORED], ids=lambda f: f.name)
def test_each_harmless_field_is_answered_and_reported(chat, spec):
    assert chat(**_body(spec.name, "x")).ignored == (spec.name,)


def test_acted_on_fields_are_the_typed_bodys():
    acted = {f.name for f in FIELDS if f.kind == ACTED and "." not in f.name}
    typed = set(ChatBody.model_fields) - {f.name for f in FIELDS if f.kind == IGNORED}
    assert acted == typed, (acted ^ typed)


def test_unknown_structured_output_keys_are_refused_and_unknown_fields_reported(chat):
    with pytest.raises(ClientError) as info:
        chat(structured_outputs={"choice": ["a", "b"], "whatever": 1})
    assert info.value.param == "structured_outputs.whatever", info.value.message
    assert chat(foo=1, bar={}).ignored == ("bar", "foo")


def test_acted_on_sampling_fields_reach_the_request(chat):
    rules = chat(ignore_eos=True, min_tokens=6, repetition_penalty=1.3, presence_penalty=0.5,
                 frequency_penalty=-0.25, logit_bias={"12": -100, "3": 5}).request.sampling.rules
    assert (rules.ignore_eos, rules.min_tokens, rules.repetition_penalty) == (True, 6, 1.3)
    assert (rules.presence_penalty, rules.frequency_penalty) == (0.5, -0.25)
    assert rules.logit_bias == ((3, 5), (12, -100))
    for fields, param in (({"repetition_penalty": 0}, "repetition_penalty"),
                          ({"presence_penalty": 2.5}, "presence_penalty"),
                          ({"min_tokens": -1}, "min_tokens"),
                          ({"ignore_eos": "yes"}, "ignore_eos"),
                          ({"logit_bias": {"a": 1}}, "logit_bias"),
                          ({"logit_bias": {"5": 101}}, "logit_bias")):
        with pytest.raises(ClientError) as info:
            chat(**fields)
        assert info.value.param == param, (fields, info.value.param, info.value.message)


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}},
    {"structured_outputs": {"json": {"type": "array"}}}, {"guided_json": '{"type": "array"}'},
    {"structured_outputs": {"regex": "[a-z]+"}}, {"guided_regex": "[a-z]+"},
    {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},
    {"guided_grammar": 'start: "yes" | "no"'}, {"structured_outputs": {"json_object": True}},
])
def test_each_structured_output_spelling_gives_a_grammar(chat, fields):
    call = chat(**fields)
    assert call.request.sampling.rules.grammar and call.ignored == (), call.ignored
    assert not call.request.sampling.plain  # masked steps are never the captured one


@pytest.mark.parametrize("fields, param, text", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format",
     "give one"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be {'type': 'text'}"),
    ({"guided_json": "{not json"}, "guided_json", "must be a JSON schema"),
    ({"guided_regex": "(a"}, "guided_regex", "cannot be followed"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar", ""),
    ({"guided_regex": "a", "min_tokens": 2}, "min_tokens", "does not go with structured"),
    ({"guided_regex": "a", "guided_choice": ["a", "b"]}, None, "scores them exactly"),
])
def test_bad_structured_output_is_a_400_naming_the_field(chat, fields, param, text):
    with pytest.raises(ClientError) as info:
        chat(**fields)
    assert info.value.status == 400 and info.value.param == param, info.value.message
    assert text in info.value.message, info.value.message


def test_the_serve_flag_reaches_the_server_options():
    import argparse
    import dataclasses

    from apbv.serve.app import ServerOptions
    from apbv.serve.main import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args([]).ignore_unsupported_fields is False
    assert parser.parse_args(["--ignore-unsupported-fields"]).ignore_unsupported_fields is True
    assert "ignore_unsupported_fields" in {f.name for f in dataclasses.fields(ServerOptions)}
