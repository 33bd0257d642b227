"""Exact greedy decode over the distributed prompt cache.

Every rank runs the whole model on the new token (hidden states are replicated). In each layer
the owning rank appends the token's KV, every rank attends the token to the KV it holds, and the
H partials are gathered and merged by log-sum-exp: exact attention over the whole prompt and the
tokens generated so far. A step's collectives are those L all-gathers and nothing else: every
rank merges the very same gathered partials in the same order, so every rank computes the same
logits and picks the same token itself. The first layer's all-gather carries two more values
per rank (:class:`DecodeContext`'s ``signal``): the query rank's stop flag, so every rank ends
at the same step, and the token the rank fed, so ranks that ever disagreed (a kernel that is
not deterministic, ranks on different hardware) fail loudly instead of merging partials of
different sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from apbv import comm
from apbv.attention import kernels
from apbv.attention.merge import merge_packed, pack_partial
from apbv.context import active
from apbv.distributed import DistInfo
from apbv.engine import readback
from apbv.engine.agree import raise_if_any_failed
from apbv.engine.answer import Answer, DecodeSettings, keeps_records
from apbv.engine.kvcache import RankKVCache
from apbv.engine.request import Request, cut_at_stop
from apbv.engine.sampling import GREEDY, Sampling, reported
from apbv.model.adapter import VideoModel
from apbv.plan import QUERY_RANK
from apbv.sequence import text_ids

if TYPE_CHECKING:  # decode_graph builds on this module
    from apbv.engine.grammar import Guide


@dataclass
class DecodeContext:
    """Exact attention of new rows (every rank feeds the same ones) over the distributed cache.

    The ``owner`` rank appends the rows' KV and attends them causally (bottom-right: each row
    sees every cached key and the new rows up to itself); every other rank attends them to
    all it holds, which precedes them. The H partials are merged by log-sum-exp. One decode
    token is the case of one row owned by the query rank; a stream's chunk is many rows.
    """

    info: DistInfo
    cache: RankKVCache
    kernel: str | None
    owner: int = QUERY_RANK
    signal: torch.Tensor | None = None
    """When set, (S,) fp32 values the next :meth:`attend`'s all-gather carries from this rank
    (then cleared): control data without a collective of its own."""
    received: torch.Tensor | None = None
    """(H, S) fp32: every rank's ``signal`` as the last all-gather that carried one got them."""
    length: torch.Tensor | None = None
    """When set, (1,) int64 on the device: the owner's cached rows before this step, and the
    step is capturable (:mod:`apbv.engine.decode_graph`): the owner writes the new rows' KV
    at that row of its preallocated buffers and attends over the whole buffers masked to
    the valid rows, so no shape or address depends on the count."""
    static_all: bool = False
    """With ``length``: every rank's rows sit in buffers of a fixed capacity (a step kept
    across requests: :class:`apbv.engine.decode_graph.GraphSteps`), so the other ranks too
    attend over their whole buffers, masked to their ``length`` cached rows."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        mine = self.info.rank == self.owner
        if not self.cache.holds(layer):  # a stream's rank that holds nothing yet
            self.cache.store(layer, k[:, :0], v[:, :0])
        if mine and self.length is not None:  # one row: it sees every valid key
            keys, values = self.cache.buffers(layer)
            keys.index_copy_(1, self.length, k)
            values.index_copy_(1, self.length, v)
            out, lse = kernels.attention_upto(q, keys, values, self.length + 1, scale)
        elif self.static_all and self.length is not None:  # a kept step's other rank
            keys, values = self.cache.buffers(layer)
            out, lse = kernels.attention_upto(q, keys, values, self.length, scale)
        else:
            if mine:
                self.cache.append(layer, k, v)
            keys, values = self.cache.layer(layer)
            out, lse = kernels.attention(q, keys, values, causal=mine, scale=scale,
                                         backend=self.kernel)
        packed = pack_partial(out, lse)  # (T, Hq, D+1)
        if self.signal is None:
            gathered = comm.all_gather(packed, self.info.group)  # (H, T, Hq, D+1)
        else:  # the signal rides at the end of the partial: still one collective
            both = comm.all_gather(torch.cat([packed.flatten(), self.signal]), self.info.group)
            self.received = both[:, packed.numel():]
            gathered = both[:, :packed.numel()].view(-1, *packed.shape)
            self.signal = None
        return merge_packed(gathered)[0].to(q.dtype)


STOP = -1
"""What a decode step yields instead of a token id when the query rank's ``stop`` said so: every
rank ends the decode at the same step."""

DIVERGED = -2
"""What a decode step yields when the ranks fed it different tokens (see the module's doc)."""


@torch.inference_mode()
def pick_token(logits: torch.Tensor, group: dist.ProcessGroup | None,
               sampling: Sampling = GREEDY, eos: Sequence[int] = (),
               guide: Guide | None = None) -> torch.Tensor:
    """The query rank's choice (greedy, or ``sampling``'s draw of step 0), broadcast to every
    rank: a (1,) int64 tensor on the logits' device, never read back here (see
    :func:`host_token`). For the prompt's first token, whose logits only the query rank
    computes whole; decode steps need no broadcast (:func:`step_token`). ``eos``: the
    model's EOS ids (for ``sampling.rules``' min_tokens); ``guide``: the grammar's state."""
    return comm.broadcast(sampling.pick(logits, 0, (), eos, guide), src=QUERY_RANK,
                          group=group)


def step_signal(device: torch.device) -> torch.Tensor:
    """The (2,) fp32 signal a decode step's first all-gather carries from each rank: [stop
    flag, the token fed] (token ids below 2**24 are exact in fp32)."""
    return torch.zeros(2, dtype=torch.float32, device=device)


@torch.inference_mode()
def step_token(logits: torch.Tensor, received: torch.Tensor, sampling: Sampling = GREEDY,
               step: int = 1, previous: Sequence[int] = (),
               eos: Sequence[int] = (), guide: Guide | None = None) -> torch.Tensor:
    """A decode step's token, picked on every rank alike from its (vocab,) ``logits`` and the
    (H, 2) signals of :func:`step_signal` that its all-gather brought: the greedy choice (or
    ``sampling``'s draw for token number ``step``, seeded by the step alone, so every rank
    draws the same), :data:`STOP` when the query rank's stop flag is set, :data:`DIVERGED`
    when the ranks fed different tokens. A (1,) int64 tensor on the logits' device, computed
    there. ``previous`` (the answer's tokens so far, the same on every rank) and ``eos`` feed
    ``sampling.rules`` (``guide``: its grammar's state on this rank)."""
    token = sampling.pick(logits, step, previous, eos, guide)
    token.masked_fill_(received[QUERY_RANK, 0] > 0, STOP)
    return token.masked_fill_((received[:, 1] != received[0, 1]).any(), DIVERGED)


_PINNED: dict[torch.dtype, torch.Tensor] = {}
"""The pinned host buffer :func:`host_token` reads a token into, one per dtype (the event wait
finishes the read before the next token's copy can start)."""


def host_token(token: torch.Tensor, group: dist.ProcessGroup | None = None,
               what: str = "the first token") -> int:
    """The value of a (1,) int64 token tensor on the host: the one read back per decoded token
    (for ``on_token``, EOS and stop texts). On CUDA it is a non-blocking copy to pinned memory
    whose event is polled (:func:`apbv.engine.readback.poll`), so only this token's work is
    waited for, and for at most ``parallel.timeout_s``: past it ``group`` is aborted and
    :class:`~apbv.engine.readback.PeerStuck` names ``what``. On the CPU a plain read."""
    if token.device.type != "cuda":
        return int(token[0])
    pinned = _PINNED.get(token.dtype)
    if pinned is None:  # allocated once per dtype, not per token (pinning is costly)
        pinned = _PINNED[token.dtype] = torch.empty(1, dtype=token.dtype, pin_memory=True)
    pinned.copy_(token, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    readback.poll(copied.query, comm.timeout_s(), what, lambda: comm.abort(group))
    return int(pinned[0])


@torch.inference_mode()
def decode_step(
    model: VideoModel, ids: torch.Tensor, positions: torch.Tensor, ctx: DecodeContext
) -> torch.Tensor:
    """Feed one token: ``ids`` (1, 1) int64 and ``positions`` (3, 1, 1) (its M-RoPE position,
    the same on all three axes), both on the model's device (nothing is built from host data
    here); returns its logits (vocab,) fp32 on the device."""
    with active(ctx):
        hidden = model.decoder(model.embed(ids), positions)
    return model.logits(hidden[0, -1]).float()


def check_decode_room(cache: RankKVCache, max_new_tokens: int, info: DistInfo) -> None:
    """On every rank, before a captured decode's first collective: the query rank's KV
    reservation holds the ``max_new_tokens - 1`` rows its replayed steps write in place (they
    cannot grow the buffers). The reservation rule guarantees it; should it ever not hold, the
    query rank's RuntimeError is raised on every rank at once (one small all-reduce) instead of
    the others waiting in the first step's all-gather for the collective timeout."""
    error = None
    if info.rank == QUERY_RANK and cache.room() < max_new_tokens - 1:
        error = RuntimeError(f"the query rank reserved {cache.room()} KV rows for the "
                             f"{max_new_tokens - 1} captured decode steps")
    raise_if_any_failed(error, info.group)


def greedy_continue(
    model: VideoModel,
    first_token: torch.Tensor,
    first_id: int,
    next_position: int,
    cache: RankKVCache,
    info: DistInfo,
    request: Request,
    settings: DecodeSettings,
    *,
    sampling: Sampling | None = None,
    guide: Guide | None = None,
) -> Answer:
    """The :class:`Answer` from ``first_token`` on (it included): its tokens and why they
    ended: ``stop`` (EOS, or the answer's text holds one of ``request.stop_texts``: every rank
    sees the same tokens, so every rank ends at the same step), ``length``
    (``request.max_new_tokens`` in total) or ``cancelled`` (``settings.stop()`` was true on the
    query rank before a step's token was picked; the other ranks' ``stop`` is not asked).
    ``settings.on_token`` is called with each new token as soon as it is picked.

    ``first_token`` is :func:`pick_token`'s (1,) tensor, ``first_id`` its value. The fed token
    stays on the device from step to step (the positions too: one tensor, advanced in place);
    each step reads back only its new token (:func:`host_token`). A step's only collectives
    are its layers' all-gathers (the first carries :func:`step_signal`); ranks found to have
    fed different tokens raise RuntimeError, on every rank at the same step.
    ``settings.graphs``: the steps after the first replay one captured step
    (:mod:`apbv.engine.decode_graph`; every rank alike), the cache's reservation taking the new
    rows in place, the step kept across requests where ``graphs`` keeps steps; only for greedy
    ``sampling`` without log-probabilities and answers of at least ``graphs.min_tokens``.
    ``sampling`` (None: ``request.sampling``) picks each token (every rank draws the same;
    ``guide``, with ``sampling.rules.grammar``, masks each step's logits on every rank alike);
    with ``sampling.logprobs`` the query rank's answer has each new token's
    :meth:`Sampling.record` (the first token's is the caller's).
    """
    sampling = request.sampling if sampling is None else sampling
    max_new_tokens, stop_texts = request.max_new_tokens, request.stop_texts
    stop, on_token, graphs = settings.stop, settings.on_token, settings.graphs
    logprobs = keeps_records(sampling, info)
    tokens = [first_id]
    eos = model.eos_token_ids
    eos_ids = tuple(sorted(eos))
    tokenizer = model.processor.tokenizer
    ctx = DecodeContext(info, cache, settings.kernel)
    token = first_token
    positions = torch.full((3, 1, 1), next_position, dtype=torch.long, device=token.device)
    signal = step_signal(token.device)
    graph = kept = None
    if graphs is not None and sampling.plain and graphs.wanted(max_new_tokens):
        check_decode_room(cache, max_new_tokens, info)
        graph = kept = graphs.step(model, ctx, max_new_tokens)
    first = True

    rules = sampling.rules

    def ended() -> str | None:
        if rules.may_end(len(tokens)) and (
                (tokens[-1] in eos and not rules.ignore_eos) or (stop_texts and cut_at_stop(
                    tokenizer.decode(tokens, skip_special_tokens=True), stop_texts)[1])):
            return "stop"
        return "length" if len(tokens) >= max_new_tokens else None

    while (reason := ended()) is None:
        if stop is not None and info.rank == QUERY_RANK and stop():
            signal[0].fill_(1.0)  # this step's token is not used: every rank ends with it
        signal[1:].copy_(token)
        if graph is not None and not first:
            token = graph.run(token, positions, signal, cache.num_tokens())[0]
            if info.rank == QUERY_RANK:
                cache.extend(1)
        else:
            fed = token
            mark = cache.lengths() if graph is not None else ()  # where a fallback goes back to
            token, logits = _eager_step(model, fed, positions, signal, ctx, sampling,
                                        tokens, eos_ids, guide)
            if graph is not None:  # the first step: the captured one must agree with it
                graph = _try_graph(graph, model, fed, positions, signal, logits, mark, info)
                if graph is None:  # its row's KV is the graph's: redo the step eagerly
                    assert graphs is not None
                    graphs.forget(kept)
                    cache.truncate(mark)
                    token, _ = _eager_step(model, fed, positions, signal, ctx)
        first = False
        positions.add_(1)
        tokens.append(host_token(token, info.group, f"decode step {len(tokens)}'s token"))
        if tokens[-1] == STOP:
            return Answer(tokens[:-1], None, "cancelled", logprobs)
        if tokens[-1] == DIVERGED:
            raise RuntimeError(
                f"the ranks fed different tokens to decode step {len(tokens) - 1} (their "
                "logits differed: a kernel that is not deterministic, or ranks on different "
                "hardware or dtypes); greedy decode needs every rank to pick the same token")
        if logprobs is not None:
            logprobs.append(sampling.record(logits, tokens[-1]))
        if on_token is not None:
            on_token(reported(tokens[-1], logprobs))
    return Answer(tokens, None, reason, logprobs)


def _eager_step(model: VideoModel, fed: torch.Tensor, positions: torch.Tensor,
                signal: torch.Tensor, ctx: DecodeContext, sampling: Sampling = GREEDY,
                previous: Sequence[int] = (0,), eos: Sequence[int] = (),
                guide: Guide | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One eager decode step feeding ``fed`` with ``signal`` carried: its token tensor (token
    number ``len(previous)`` after the answer's tokens ``previous``, picked by ``sampling``)
    and logits."""
    ctx.signal = signal
    logits = decode_step(model, fed.view(1, 1), positions, ctx)
    assert ctx.signal is None and ctx.received is not None, "the signal was not gathered"
    return step_token(logits, ctx.received, sampling, len(previous), previous, eos,
                      guide), logits


def _try_graph(graph: Any, model: VideoModel, fed: torch.Tensor, positions: torch.Tensor,
               signal: torch.Tensor, eager_logits: torch.Tensor, mark: tuple[int, ...],
               info: DistInfo) -> Any:
    """The first step again as the captured step, over the rows the eager one had: the
    :class:`~apbv.engine.decode_graph.GraphStep` when every rank captured it and its logits
    agree with the eager ones on every rank (the row it wrote is then counted), else None
    (with a warning). Two small collectives, once per decode."""
    from apbv.engine.decode_graph import agrees, fall_back

    cache = graph.ctx.cache
    cache.truncate(mark)
    graph.load(fed, positions, signal, cache.num_tokens())
    failed = graph.capture()
    if comm.any_rank(failed is not None, info.group):  # before a replay's collectives
        fall_back(failed or "another rank's capture failed")
        return None
    _, logits = graph.replay()
    ok, why = agrees(logits, eager_logits, model.dtype, info.group)
    if not ok:
        fall_back(why)
        return None
    if info.rank == QUERY_RANK:
        cache.extend(1)
    return graph


def choice_token_ids(tokenizer: Any, choices: Sequence[str]) -> list[list[int]]:
    """Each choice's token ids, as plain text (special-token strings are text)."""
    return [text_ids(tokenizer, choice) for choice in choices]


def choice_table(texts: Sequence[str], choice_ids: list[list[int]],
                 logprobs: list[float]) -> list[dict[str, Any]]:
    """Per choice {"text", "tokens", "logprob", "prob"}: prob is the softmax over the choices'
    sequence log-probabilities."""
    probs = torch.softmax(torch.tensor(logprobs, dtype=torch.float64), dim=0).tolist()
    return [{"text": t, "tokens": len(ids), "logprob": lp, "prob": p}
            for t, ids, lp, p in zip(texts, choice_ids, logprobs, probs, strict=True)]


def decode_reserve(max_new_tokens: int,
                   choice_ids: list[list[int]] | None) -> tuple[int, str]:
    """(tokens decode may add after the prompt, what they are): ``max_new_tokens``, or with
    choices (``choice_ids``: :func:`choice_token_ids` of them) the longest choice's count."""
    if choice_ids is None:
        return max_new_tokens, "max_new_tokens"
    return max(map(len, choice_ids)), "the longest choice"
