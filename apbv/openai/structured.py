"""Structured output fields of a chat body, read into one grammar
(:attr:`apbv.engine.logits_rules.LogitsRules.grammar`, llguidance's serialised form).

OpenAI's ``response_format`` (``json_object``, ``json_schema``; ``text`` is free text) and
vLLM's ``structured_outputs`` keys ``json`` / ``regex`` / ``grammar`` / ``json_object`` and
their older ``guided_json`` / ``guided_regex`` / ``guided_grammar`` spellings each give one
grammar; at most one of them may be given (the closed vocabulary, ``structured_outputs.choice``
and its spellings, is scored exactly instead: :func:`apbv.openai.chat_body.choice_set`).
Every refusal is a ClientError(400) naming the field; whether the grammar fits the model's
tokenizer is checked with the request's other limits (:func:`apbv.openai.chat.check_request`).
"""

from __future__ import annotations

import json
from typing import Any

from apbv.openai.policy import ClientError

GRAMMAR_FIELDS = ("response_format", "structured_outputs.json", "structured_outputs.regex",
                  "structured_outputs.grammar", "structured_outputs.json_object",
                  "guided_json", "guided_regex", "guided_grammar")
"""The fields that give a grammar (the docs' table classes them "acted on")."""
MAX_GRAMMAR_CHARS = 65536
"""Longest schema, regex or grammar text accepted (characters)."""
JSON_OPTIONS = {"whitespace_flexible": False}
"""JSON answers are compact (``{"a": 1}``): no run of whitespace for a model to wander in (a
schema's own ``x-guidance`` options may say otherwise)."""


def json_grammar(schema: str) -> str:
    """llguidance's grammar of the JSON ``schema`` (text), compact."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]


def _given(body: dict) -> dict[str, Any]:
    outputs = body.get("structured_outputs")
    outputs = outputs if isinstance(outputs, dict) else {}
    out = {}
    for name in GRAMMAR_FIELDS:
        head, _, key = name.partition(".")
        value = outputs.get(key) if key else body.get(head)
        if value is None or (name == "response_format" and value == {"type": "text"}) or \
                (name == "structured_outputs.json_object" and value is False):
            continue
        out[name] = value
    return out


def _schema(name: str, value: Any) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ClientError(400, f"{name} must be a JSON schema (an object, or its JSON "
                                   "text)", param=name) from None
    if not isinstance(value, dict | bool):
        raise ClientError(400, f"{name} must be a JSON schema object, got "
                               f"{type(value).__name__}", param=name)
    return json.dumps(value)


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ClientError(400, f"{name} must be a non-empty string", param=name)
    return value


def grammar(body: dict) -> tuple[str, str] | None:
    """(the field that gave it, llguidance's grammar) of the body's structured output, or None
    without one; ClientError(400) naming the field when it is malformed, when two are given,
    or when the grammar engine is not installed."""
    given = _given(body)
    if len(given) > 1:
        names = sorted(given)
        raise ClientError(400, f"{' and '.join(names)} each ask for structured output: give one",
                          param=names[-1])
    if not given:
        return None
    (name, value), = given.items()
    if len(json.dumps(value)) > MAX_GRAMMAR_CHARS:
        raise ClientError(400, f"{name} is {len(json.dumps(value))} characters long as JSON; "
                               f"the limit is {MAX_GRAMMAR_CHARS}", param=name)
    try:
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark
    except ImportError:
        raise ClientError(400, f"{name}: structured output needs the llguidance package, "
                               "which this server lacks (pip install llguidance)",
                          param=name) from None
    if name == "response_format":
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "json_object":
            return name, json_grammar(json.dumps({"type": "object"}))
        if kind != "json_schema" or not isinstance(value.get("json_schema"), dict):
            raise ClientError(400, f"response_format must be {{'type': 'text'}}, "
                                   f"{{'type': 'json_object'}} or {{'type': 'json_schema', "
                                   f"'json_schema': {{'name', 'schema'}}}}, got {value!r:.200}",
                              param=name)
        schema = value["json_schema"].get("schema", {"type": "object"})
        return name, json_grammar(_schema(name, schema))
    if name == "structured_outputs.json_object":
        if value is not True:
            raise ClientError(400, f"{name} must be true or false, got {value!r:.100}",
                              param=name)
        return name, json_grammar(json.dumps({"type": "object"}))
    if name.endswith("json"):
        return name, json_grammar(_schema(name, value))
    if name.endswith("regex"):
        return name, LLMatcher.grammar_from_regex(_text(name, value))
    try:
        return name, LLMatcher.grammar_from_lark(any_to_lark(_text(name, value)))
    except ClientError:
        raise
    except Exception as exc:  # the converter's own errors: the grammar is malformed
        raise ClientError(400, f"{name} is not a Lark or GBNF grammar: {str(exc)[:200]}",
                          param=name) from None
