"""The lines of an ``apbv batch`` input file: each line's envelope (``custom_id``, ``method``,
``url``) read apart from its body, and the body read exactly as the server reads an HTTP body.

:func:`read_requests` refuses the file before the model loads when a line is no request at
all (not a JSON object, no ``custom_id``, a ``custom_id`` given twice, another method or URL):
those cannot be answered. A line whose envelope is fine but whose body the server's strict
reader refuses (:func:`apbv.openai.bodies.decode_json`: a lone surrogate, NaN, nesting past 64
levels, an integer of too many digits) is kept with its refusal (``"refused"``, a
:class:`~apbv.openai.policy.ClientError`): the run answers it with that error row, as the
server would answer the body with a 400, and goes on. The envelope is scanned without
descending into nested values (:func:`envelope`), so no line can exhaust the stack, however
deep; every rank reads the same file the same way.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from apbv.openai.bodies import decode_json
from apbv.openai.policy import ClientError

BATCH_URL = "/v1/chat/completions"

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")
_SURROGATE = re.compile("[\ud800-\udfff]")


class Nested:
    """The raw text of a nested value (an array or object) of a line's top level."""

    def __init__(self, text: str) -> None:
        self.text = text


def envelope(line: str) -> dict[str, Any] | None:
    """The top-level keys of the JSON object ``line``: scalars decoded, nested values (arrays,
    objects) as :class:`Nested` raw text, not decoded; None when ``line`` is not one JSON
    object. Linear in the line's length, without recursion."""
    i = _SPACE.match(line, 0).end()  # type: ignore[union-attr]
    if line[i:i + 1] != "{":
        return None
    out: dict[str, Any] = {}
    i = _SPACE.match(line, i + 1).end()  # type: ignore[union-attr]
    if line[i:i + 1] == "}":
        return out if not line[_SPACE.match(line, i + 1).end():] else None  # type: ignore
    while True:
        if line[i:i + 1] != '"':
            return None
        try:
            key, i = _DECODER.raw_decode(line, i)
        except ValueError:
            return None
        i = _SPACE.match(line, i).end()  # type: ignore[union-attr]
        if line[i:i + 1] != ":":
            return None
        i = _SPACE.match(line, i + 1).end()  # type: ignore[union-attr]
        if line[i:i + 1] in ("[", "{"):
            end = _skip_nested(line, i)
            if end < 0:
                return None
            value: Any = Nested(line[i:end])
            i = end
        else:
            try:
                value, i = _DECODER.raw_decode(line, i)
            except ValueError:
                return None
        out[key] = value
        i = _SPACE.match(line, i).end()  # type: ignore[union-attr]
        if line[i:i + 1] == ",":
            i = _SPACE.match(line, i + 1).end()  # type: ignore[union-attr]
            continue
        if line[i:i + 1] == "}" and not line[_SPACE.match(line, i + 1).end():]:  # type: ignore
            return out
        return None


def _skip_nested(text: str, start: int) -> int:
    """The index just past the array or object opening at ``start`` (strings skipped whole),
    or -1 when it never closes."""
    depth, i, n = 0, start, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def read_line(line: str, where: str) -> dict[str, Any]:
    """One request line: {"custom_id", "method", "url", "body", "refused"} (``body`` the
    decoded object, or None with ``refused`` the strict reader's ClientError), or ValueError
    naming ``where`` (the file and line) when the line is no request."""
    item = envelope(line)
    if item is None:
        try:
            json.loads(line)
        except RecursionError:
            raise ValueError(f"{where} is not a JSON object (it nests too deep to read)") \
                from None
        except ValueError as exc:
            raise ValueError(f"{where} is not JSON: {exc}") from None
        raise ValueError(f"{where} must be an object with a non-empty string custom_id and "
                         "an object body")
    cid, body = item.get("custom_id"), item.get("body")
    if not isinstance(cid, str) or not cid or _SURROGATE.search(cid) or \
            not isinstance(body, Nested) or not body.text.startswith("{"):
        raise ValueError(f"{where} must be an object with a non-empty string custom_id and "
                         "an object body")
    method, url = item.get("method", "POST"), item.get("url", BATCH_URL)
    if method != "POST" or url != BATCH_URL:
        raise ValueError(f"{where}: only POST {BATCH_URL} is supported, got "
                         f"{_shown(method)} {_shown(url)}")
    try:
        decoded, refused = decode_json(body.text.encode("utf-8", "surrogateescape")), None
    except ClientError as exc:
        decoded, refused = None, exc
    return {"custom_id": cid, "method": method, "url": url, "body": decoded,
            "refused": refused}


def read_requests(path: str | Path) -> list[dict[str, Any]]:
    """The input file's request lines (:func:`read_line`; blank lines skipped), or ValueError
    naming the first line that is no request, or a ``custom_id`` given twice."""
    out: list[dict[str, Any]] = []
    seen: dict[str, int] = {}  # custom_id -> the line that gave it
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            line = raw.decode("utf-8", "surrogateescape")  # bad bytes: the body's reader says
            if not line.strip():
                continue
            item = read_line(line, f"{path} line {number}")
            if item["custom_id"] in seen:
                raise ValueError(f"{path} line {number}: custom_id {item['custom_id'][:100]!r} "
                                 f"was given on line {seen[item['custom_id']]} already")
            seen[item["custom_id"]] = number
            out.append(item)
    return out


def _shown(value: object) -> str:
    text = value.text if isinstance(value, Nested) else value
    return repr(str(text)[:100])
