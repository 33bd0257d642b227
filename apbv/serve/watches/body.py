"""The body of ``POST /v1/streams/{id}/watches`` checked into a :class:`Watch` before any work
(:func:`parse_watch`): a 400 naming the field, its limit or its allowed values otherwise."""

from __future__ import annotations

import uuid
from typing import Any

from apbv.engine.request import Request as EngineRequest
from apbv.engine.request import StreamRef
from apbv.openai import chat_body
from apbv.openai.bodies import check_url
from apbv.openai.policy import ClientError
from apbv.serve.watches.events import Webhook
from apbv.serve.watches.state import Watch
from apbv.serve.watches.webhook import webhook_url
from apbv.watch.rules import Rule

WATCH_FIELDS = {"question", "choices", "every_s", "rule", "choice", "threshold", "hysteresis",
                "hold", "webhook"}


def parse_watch(server: Any, stream_id: str, body: object) -> Watch:
    """The watch ``body`` asks for on stream ``stream_id`` of ``server`` (its config, limits
    and media policy), checked (400 naming the field) before any work."""
    if not isinstance(body, dict):
        raise ClientError(400, "the body must be a JSON object")
    unknown = sorted(set(body) - WATCH_FIELDS)
    if unknown:
        raise ClientError(400, f"unknown field(s) {unknown}; supported: "
                               f"{sorted(WATCH_FIELDS)}")
    limits = server.opt.limits
    question = body.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ClientError(400, "question must be a non-empty string")
    limits.check("question", len(question), limits.max_question_chars,
                 "max-question-chars", "the question's length in characters")
    if body.get("choices") is None:
        raise ClientError(400, "choices is required: a watch answers from a closed "
                               "vocabulary (e.g. [\"yes\", \"no\"])")
    every_s = chat_body.typed_field(body, "every_s", (int, float))
    if every_s is not None and every_s <= 0:
        raise ClientError(400, f"every_s must be > 0 seconds of footage, got {every_s}")
    try:
        ask = EngineRequest.from_config(
            server.cfg, StreamRef(stream_id), question, mode="exact",
            max_new_tokens=1, choices=body["choices"])
        assert ask.choices is not None
        rule = Rule(kind=_field(body, "rule", (str,), "change"),
                    choice=chat_body.typed_field(body, "choice", (str,)),
                    threshold=float(_field(body, "threshold", (int, float), 0.5)),
                    hysteresis=float(_field(body, "hysteresis", (int, float), 0.1)),
                    hold=_field(body, "hold", (int,), 1))
        rule.check_choices(ask.choices)
    except ValueError as exc:
        raise ClientError(400, str(exc)) from None
    webhook = None
    if body.get("webhook") is not None:
        hosts = server.opt.webhook_hosts
        webhook = Webhook(webhook_url(check_url(body["webhook"], "webhook"), hosts), hosts)
    return Watch("watch-" + uuid.uuid4().hex[:16], stream_id, ask, rule, every_s, webhook)


def _field(body: dict, name: str, kinds: tuple[type, ...], default: Any) -> Any:
    """``body[name]`` checked by :func:`apbv.openai.chat_body.typed_field`; ``default`` when absent
    (only then: a 0 given is kept, for the rule to refuse or take)."""
    value = chat_body.typed_field(body, name, kinds)
    return default if value is None else value
