"""Request bodies read strictly: JSON only as ``application/json``, nesting bounded, numbers
finite and in range, text without lone surrogates, URLs without control characters.

Every refusal is a :class:`apbv.openai.policy.ClientError` (415 or 400) naming the problem, the
place in the body (``messages[0].content[1].text``) and the limit, before any work is spent:
what a client sends is data, and nothing malformed gets as far as the tokenizer, a file name or
a URL parser (where it used to surface as a plain-text 500).
"""

from __future__ import annotations

import json
import re
from typing import Any

from apbv.openai.policy import ClientError

JSON_TYPE = "application/json"
MAX_DEPTH = 64
"""Nesting levels of arrays and objects in a body (the top-level value is level 1)."""
MAX_INT_DIGITS = 19
"""Digits of an integer at most: a seed reaches 2**63 - 1 (19 digits); every field checks
its own range after this."""

_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def check_content_type(value: str | None) -> None:
    """415 unless ``value`` (the Content-Type header) is ``application/json`` (parameters such
    as ``charset=utf-8`` allowed): a web page cannot send that without a CORS preflight."""
    if (value or "").split(";", 1)[0].strip().lower() != JSON_TYPE:
        shown = "none" if value is None else repr(value[:80])
        raise ClientError(415, f"the request body must be JSON sent with 'Content-Type: "
                               f"{JSON_TYPE}', got Content-Type {shown}")


def decode_json(body: bytes) -> Any:
    """The JSON value of ``body``, or ClientError(400) naming what is wrong: not UTF-8 JSON,
    nested deeper than :data:`MAX_DEPTH`, NaN/Infinity or a number that overflows a double,
    an integer of more than :data:`MAX_INT_DIGITS` digits, a string or key with a lone
    surrogate (which no encoder can write: the tokenizer and file names would fail on it)."""
    try:
        value = json.loads(body, parse_constant=_refuse_constant, parse_float=_finite_float,
                           parse_int=_bounded_int)
    except RecursionError:
        raise ClientError(400, f"the request body is nested deeper than {MAX_DEPTH} levels "
                               "(arrays and objects)") from None
    except ValueError as exc:
        raise ClientError(400, f"the request body is not JSON: {str(exc)[:200]}") from None
    check_tree(value)
    return value


def check_tree(value: object, max_depth: int = MAX_DEPTH) -> None:
    """ClientError(400) if ``value`` (decoded JSON) nests deeper than ``max_depth`` or holds a
    lone surrogate in a string or key; walked without recursion."""
    stack: list[tuple[object, tuple, int]] = [(value, (), 1)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > max_depth:
                raise ClientError(400, f"the request body is nested deeper than {max_depth} "
                                       f"levels (arrays and objects), at {where(path)}")
            for key, child in item.items() if isinstance(item, dict) else enumerate(item):
                if isinstance(key, str) and _SURROGATE.search(key):
                    _surrogate(key, f"a key of {where(path)}")
                stack.append((child, (path, key), depth + 1))
        elif isinstance(item, str) and _SURROGATE.search(item):
            _surrogate(item, where(path))


def where(path: tuple) -> str:
    """``messages[0].content[1].text`` for the nested ``(parent, key)`` pairs of ``path``."""
    keys: list[str | int] = []
    while path:
        path, key = path
        keys.append(key)
    out = "".join(f"[{k}]" if isinstance(k, int) else f".{k[:40]}" for k in reversed(keys))
    return repr(out.lstrip(".")) if out else "the top level"


def check_url(value: object, name: str) -> str:
    """``value`` if it is a non-empty string without control characters (C0, DEL, C1: a URL
    holds them percent-encoded), else ClientError(400) naming ``name`` and the character."""
    if not isinstance(value, str) or not value:
        raise ClientError(400, f"{name} must be a non-empty string, got "
                               f"{type(value).__name__}")
    bad = _CONTROL.search(value)
    if bad is not None:
        raise ClientError(400, f"{name} holds the control character U+{ord(bad.group()):04X} "
                               f"at position {bad.start()}; percent-encode it in the URL")
    return value


def _surrogate(text: str, place: str) -> None:
    found = _SURROGATE.search(text)
    assert found is not None
    raise ClientError(400, f"{place} holds a lone surrogate (U+{ord(found.group()):04X} at "
                           f"position {found.start()}), which is not a character: send valid "
                           "UTF-8 (a \\uXXXX escape only as a high-low pair)")


def _refuse_constant(name: str) -> Any:
    raise ClientError(400, f"{name} is not a JSON number: numbers must be finite")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ClientError(400, f"the number {text[:40]} overflows a double: numbers must be "
                               "finite")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ClientError(400, f"the integer {text[:40]}{'...' if len(text) > 40 else ''} has "
                               f"{len(text.lstrip('-'))} digits, more than {MAX_INT_DIGITS}")
    return int(text)
