"""The answer path's records: how this rank decodes an answer (:class:`DecodeSettings`), what
came out (:class:`Answer`) and what ran for the prompt (:class:`PromptStats`).

:func:`apbv.engine.runner.finish_answer` and :func:`apbv.engine.decode.greedy_continue` take
the :class:`~apbv.engine.request.Request` (choices, length, stop texts, sampling) and a
:class:`DecodeSettings` and return an :class:`Answer`; :func:`apbv.engine.runner.build_result`
makes the :class:`~apbv.engine.request.Result` from the request, the answer and the
:class:`PromptStats`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from apbv.plan import QUERY_RANK

if TYPE_CHECKING:
    import torch

    from apbv.distributed import DistInfo
    from apbv.engine.decode_graph import GraphSteps
    from apbv.engine.sampling import Sampling


@dataclass(frozen=True)
class DecodeSettings:
    """How this rank decodes an answer (what the request does not say)."""

    kernel: str | None = None
    """The attention kernel serving the decode (the request's; a stream's own for a held
    ask)."""
    graphs: GraphSteps | None = None
    """Greedy decode replays a captured step (``decode.graphs``, resolved by the engine:
    :class:`apbv.engine.decode_graph.GraphSteps`); None: eager."""
    on_token: Callable[[int], None] | None = None
    """Called (every rank) with each token as soon as it is known, the first one included."""
    stop: Callable[[], bool] | None = None
    """Asked on the query rank between decode steps: True ends the answer (``cancelled``)."""


@dataclass
class Answer:
    """One answer's tokens and why it ended."""

    tokens: list[int]
    """The generated tokens (with choices: the likeliest choice's)."""
    choices: list[dict[str, Any]] | None
    """With the request's choices: the per-choice table of :attr:`Result.choices
    <apbv.engine.request.Result.choices>`."""
    finish: str
    """``stop``, ``length`` or ``cancelled`` (:attr:`apbv.engine.request.Result.finish_reason`)."""
    logprobs: list[dict[str, Any]] | None = None
    """On the query rank, with ``sampling.logprobs``: each generated token's
    :meth:`~apbv.engine.sampling.Sampling.record`; else None."""


@dataclass(frozen=True)
class PromptStats:
    """What ran for the prompt, as the :class:`~apbv.engine.request.Result` reports it."""

    mode: str
    frames: int
    context_len: int
    query_len: int
    logits: torch.Tensor
    """(vocab,) fp32: the prompt's last logits (:attr:`Result.first_logits
    <apbv.engine.request.Result.first_logits>`)."""
    anchor_len: int = 0
    passing_len: int = 0
    embedding_bytes: int = 0
    allgather_bytes: int = 0
    vision_cache_hit: bool = False
    snapped: Sequence[tuple[int, int, int]] | None = None
    """(position, frame, keyframe) of each frame moved onto a keyframe, or None."""


def keeps_records(sampling: Sampling, info: DistInfo) -> list[dict[str, Any]] | None:
    """A new list for the answer's token records where this rank keeps them (the query rank,
    with ``sampling.logprobs``), else None."""
    return [] if sampling.logprobs is not None and info.rank == QUERY_RANK else None
