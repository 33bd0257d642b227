"""The pure rules of the server's metrics (:mod:`apbv.serve.front.metrics`): the name prefix, the
bucket lists, and which ``endpoint`` and ``finished_reason`` a finished job is counted under.

Buckets: the metrics that carry vLLM's names use vLLM's bucket bounds (so a vLLM dashboard's
bucket queries, ``le="0.5"`` and the like, read the same), with finer bounds added below
vLLM's first one where apbv's requests are shorter than vLLM's lists allow for (stream asks
take milliseconds): every vLLM bound is kept.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from apbv.serve.scheduler.admission import Job

DEFAULT_PREFIX = "apbv"
PREFIX_RULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}\Z")
"""A prefix is a Prometheus name part: a letter or ``_``, then letters, digits or ``_``, at
most 32 characters (``apbv``, ``vllm``, ``sglang``)."""

ENDPOINTS = ("chat", "stream_ask", "watch")
"""What a finished request was: a chat completion, an ask on a live stream, or a standing
question's evaluation (a watch)."""
FINISHED_REASONS = ("stop", "length", "abort", "error")
"""vLLM's ``finished_reason`` values: the answer ended (an end token, a stop text or a choice
scored), ``max_tokens`` reached, the client went away (cancelled or dropped while queued), or
the request failed after its admission (a rank lost, a missed deadline, an engine error)."""

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
"""vLLM's ``time_to_first_token_seconds`` bounds (seconds): also apbv's own latencies
(capture to event, the engine's TTFT, queue wait, stages)."""
_VLLM_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
REQUEST_BUCKETS = tuple(b for b in TTFT_BUCKETS if b < _VLLM_REQUEST[0]) + _VLLM_REQUEST
"""vLLM's request-latency bounds (e2e, queue, prefill, decode, inference; 0.3 .. 7680 s) with
the TTFT bounds under 0.3 s before them (a stream ask's whole answer can take 5 ms)."""
_VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
             7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005) + _VLLM_ITL
"""vLLM's inter-token bounds (0.01 .. 80 s) with 1, 2.5 and 5 ms before them (a small model
decodes a token in milliseconds)."""


def check_prefix(prefix: str) -> str:
    """``prefix`` when it is a valid metric-name prefix (:data:`PREFIX_RULE`), else
    ValueError naming the rule."""
    if not isinstance(prefix, str) or not PREFIX_RULE.match(prefix):
        raise ValueError(f"--metrics-prefix must be 1 to 32 letters, digits or '_' not "
                         f"starting with a digit (e.g. {DEFAULT_PREFIX} or vllm), got "
                         f"{prefix!r}")
    return prefix


def one_two_five(most: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``most`` (vLLM's token-count bounds up to its
    ``max_model_len``), and ``most`` itself as the last bound when the series skips it."""
    if most < 1:
        raise ValueError(f"the largest token-count bound must be >= 1, got {most}")
    bounds: list[int] = []
    scale = 1
    while scale <= most:
        bounds.extend(m * scale for m in (1, 2, 5) if m * scale <= most)
        scale *= 10
    if bounds[-1] != most:
        bounds.append(most)
    return tuple(bounds)


def endpoint_of(job: Job) -> str | None:
    """The :data:`ENDPOINTS` value of a finished replica job
    (:class:`~apbv.serve.scheduler.admission.Job`): ``chat`` for a chat request's, ``watch``
    for a standing question's evaluation, ``stream_ask`` for another question on a live
    stream; None for a stream's other operations (open, append, describe, close), which are
    not requests."""
    if job.call is not None:
        return "chat"
    if getattr(job.op, "what", None) != "generate":
        return None
    return "watch" if job.evaluates is not None else "stream_ask"


def finished_reason(outcome: str, result: Any) -> str:
    """The :data:`FINISHED_REASONS` value of a job that ended with ``outcome`` (the replica's
    word: ``ok``, ``stream``, ``cancelled``, ``disconnected``, ``rank_lost``, ...) and
    ``result`` (None when it has none)."""
    if outcome in ("cancelled", "disconnected"):
        return "abort"
    reason = getattr(result, "finish_reason", None)
    if result is None or reason is None:
        return "error"
    return {"cancelled": "abort", "length": "length"}.get(reason, "stop")
