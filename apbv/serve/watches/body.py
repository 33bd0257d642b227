"""The body of ``POST /v1/streams/{id}/watches`` checked into a :class:`Watch` before any work
(:func:`parse_watch`): a 400 naming the field, its limit or its allowed values otherwise."""

from __future__ import annotations

import uuid

from apbv.engine.request import Request as EngineRequest
from apbv.engine.request import StreamRef
from apbv.openai.ask import question_of
from apbv.openai.bodies import check_url
from apbv.openai.chat_body import typed_field
from apbv.openai.policy import ClientError
from apbv.serve.front.front import Front
from apbv.serve.watches.events import Webhook
from apbv.serve.watches.state import Watch
from apbv.serve.watches.webhook import webhook_url
from apbv.watch.rules import Rule

WATCH_FIELDS = {"question", "choices", "every_s", "rule", "choice", "threshold", "hysteresis",
                "hold", "webhook"}


def parse_watch(front: Front, stream_id: str, body: object) -> Watch:
    """The watch ``body`` asks for on stream ``stream_id`` under ``front`` (the server's
    config, limits and webhook hosts), checked (400 naming the field) before any work."""
    if not isinstance(body, dict):
        raise ClientError(400, "the body must be a JSON object")
    unknown = sorted(set(body) - WATCH_FIELDS)
    if unknown:
        raise ClientError(400, f"unknown field(s) {unknown}; supported: "
                               f"{sorted(WATCH_FIELDS)}")
    question = question_of(body, front.limits)
    if body.get("choices") is None:
        raise ClientError(400, "choices is required: a watch answers from a closed "
                               "vocabulary (e.g. [\"yes\", \"no\"])")
    every_s = typed_field(body, "every_s", (int, float))
    if every_s is not None and every_s <= 0:
        raise ClientError(400, f"every_s must be > 0 seconds of footage, got {every_s}")
    try:
        ask = EngineRequest.from_config(
            front.cfg, StreamRef(stream_id), question, mode="exact",
            max_new_tokens=1, choices=body["choices"])
        assert ask.choices is not None
        rule = Rule(kind=typed_field(body, "rule", (str,), default="change"),
                    choice=typed_field(body, "choice", (str,)),
                    threshold=float(typed_field(body, "threshold", (int, float), default=0.5)),
                    hysteresis=float(typed_field(body, "hysteresis", (int, float),
                                                 default=0.1)),
                    hold=typed_field(body, "hold", (int,), default=1))
        rule.check_choices(ask.choices)
    except ValueError as exc:
        raise ClientError(400, str(exc)) from None
    webhook = None
    if body.get("webhook") is not None:
        hosts = front.webhook_hosts
        webhook = Webhook(webhook_url(check_url(body["webhook"], "webhook"), hosts), hosts)
    return Watch(ask, rule, every_s, id="watch-" + uuid.uuid4().hex[:16], stream=stream_id,
                 webhook=webhook)

