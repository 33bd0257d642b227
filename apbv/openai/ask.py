"""The body of a live stream's ask (``POST /v1/streams/{id}/ask``) read into a
:class:`~apbv.engine.request.Request` over the stream (:func:`parse_ask`), and the question
check it shares with a standing question's body (:func:`question_of`): a 400 naming the field,
its limit or its allowed values, before any work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from apbv.engine.request import Request, StreamRef
from apbv.openai.chat_body import typed_field
from apbv.openai.policy import ClientError, Limits

if TYPE_CHECKING:
    from apbv.config import RuntimeConfig

ASK_FIELDS = {"question", "max_tokens", "choices", "fresh", "stream", "stop"}
FRESH_MODE = "spava"
"""The mode of a fresh ask (a one-shot prefill of the held window); an ask over the held KV
is ``exact``."""


@dataclass(frozen=True)
class Ask:
    """A stream's ask: its request, and whether its answer is streamed (server-sent events)."""

    request: Request
    streamed: bool


def question_of(body: dict, limits: Limits) -> str:
    """The body's ``question``: a non-empty string within --max-question-chars."""
    question = body.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ClientError(400, "question must be a non-empty string")
    limits.check("question", len(question), limits.max_question_chars, "max-question-chars",
                 "the question's length in characters")
    return question


def parse_ask(body: object, stream_id: str, cfg: RuntimeConfig, limits: Limits) -> Ask:
    """The ask ``body`` makes of stream ``stream_id``, checked as a chat request is (fields,
    --max-question-chars, --max-tokens; the engine's request checks)."""
    if not isinstance(body, dict) or set(body) - ASK_FIELDS:
        raise ClientError(400, f"the body must be a JSON object with fields among "
                               f"{sorted(ASK_FIELDS)}")
    question = question_of(body, limits)
    max_tokens = typed_field(body, "max_tokens", (int,), 1) or cfg.generate.max_new_tokens
    limits.check("max_tokens", max_tokens, limits.max_tokens, "max-tokens", "max_tokens")
    fresh = bool(typed_field(body, "fresh", (bool,)))
    streamed = bool(typed_field(body, "stream", (bool,)))
    try:  # the engine's Request checks, as for a chat request
        request = Request.from_config(
            cfg, StreamRef(stream_id, fresh), question,
            mode=FRESH_MODE if fresh else "exact", max_new_tokens=max_tokens,
            choices=body.get("choices"),
            stop_texts=() if body.get("stop") is None else body["stop"])
    except ValueError as exc:
        raise ClientError(400, str(exc)) from None
    return Ask(request, streamed)
