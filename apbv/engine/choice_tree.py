"""Closed-vocabulary choices scored in one forward over the distributed cache: the choices'
tokens as a tree (a prefix two choices share is one node), every node fed at once (up to
:data:`NODE_CHUNK` a forward), each row attending exactly to the whole cache and to its own
ancestors in the tree.

A choice's first token is scored by the prompt's logits; token j + 1 of it by the logits of
the node that feeds its token j (the node of its first j + 1 tokens), at position
``next_position + j`` on all three M-RoPE axes: the rows, positions and visible keys of
teacher-forcing each choice after the prompt, so the log-probabilities are those of feeding
the choices one token at a time (:func:`score_choices`), in one pass instead of one decode step
(L all-gathers) per fed token. The nodes' KV is kept by the query rank for the pass and
forgotten after it; the cache is the prompt's again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from apbv import comm
from apbv.attention import kernels
from apbv.attention.merge import merge_packed, merge_partials, pack_partial
from apbv.context import active
from apbv.distributed import DistInfo
from apbv.engine.decode import DecodeContext, decode_reserve
from apbv.engine.kvcache import RankKVCache
from apbv.model.adapter import VideoModel
from apbv.plan import QUERY_RANK

NODE_CHUNK = 128
"""Nodes fed in one forward at most (a chunk's scores are rows x nodes, its logits rows x
vocabulary): 64 choices of 256 characters make thousands of nodes."""


@dataclass(frozen=True)
class ChoiceTree:
    """The nodes fed to score choices: every distinct prefix of a choice but the whole one, an
    ancestor always before its descendants."""

    tokens: list[int]
    """(N,) the token each node feeds (the last of its prefix)."""
    depths: list[int]
    """(N,) the index of that token in its choices (the node's position after the prompt)."""
    parents: list[int]
    """(N,) each node's parent (-1: a first token, its parent is the prompt)."""
    paths: list[list[int]]
    """Per choice, the node feeding each of its tokens but the last (len(choice) - 1)."""

    def visible(self, start: int, end: int) -> torch.Tensor:
        """(end - start, end) bool: node r of [start, end) attends node c < end iff c is r or
        one of its ancestors."""
        out = torch.zeros(end - start, end, dtype=torch.bool)
        for row in range(start, end):
            node = row
            while node >= 0:
                out[row - start, node] = True
                node = self.parents[node]
        return out


def choice_tree(choice_ids: Sequence[Sequence[int]]) -> ChoiceTree:
    """The tree of ``choice_ids`` (each choice's token ids, non-empty)."""
    index: dict[tuple[int, ...], int] = {}
    tokens: list[int] = []
    depths: list[int] = []
    parents: list[int] = []
    for ids in choice_ids:
        for j in range(len(ids) - 1):
            prefix = tuple(ids[:j + 1])
            if prefix not in index:
                index[prefix] = len(tokens)
                tokens.append(ids[j])
                depths.append(j)
                parents.append(index[prefix[:-1]] if j else -1)
    paths = [[index[tuple(ids[:j + 1])] for j in range(len(ids) - 1)] for ids in choice_ids]
    return ChoiceTree(tokens, depths, parents, paths)


def kv_reserve(max_new_tokens: int, choice_ids: list[list[int]] | None) -> int:
    """Rows the query rank's cache takes after the prompt: ``max_new_tokens``, or with choices
    the nodes of their tree (at least the longest choice's count, which bounds the positions:
    :func:`apbv.engine.decode.decode_reserve`)."""
    reserve, _ = decode_reserve(max_new_tokens, choice_ids)
    return reserve if choice_ids is None else max(reserve, len(choice_tree(choice_ids).tokens))


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows q (1, T, Hq, D) over k/v (1, K, Hkv, D) where ``visible`` (T, K) bool allows (every
    row must see one key): out (1, T, Hq, D) in q's dtype, lse (1, Hq, T) fp32, fp32 scores."""
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.float().view(b, tq, hkv, hq // hkv, d)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.float()) * scale  # (B, Hkv, G, Tq, Tk)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.float()).reshape(b, tq, hq, d)
    return out.to(q.dtype), lse.reshape(b, hq, tq)


@dataclass
class TreeContext(DecodeContext):
    """:class:`DecodeContext` of a chunk of a tree's nodes: the owner attends them to the prompt
    (its first ``prompt`` rows per layer) and to their ancestors among the nodes fed before and
    now (``visible``), then keeps their KV; every other rank attends them to all it holds. The
    partials are merged by log-sum-exp."""

    prompt: tuple[int, ...] = ()
    """The owner's cached rows per layer before the first node (:meth:`RankKVCache.lengths`)."""
    visible: torch.Tensor | None = None
    """(C, F + C) bool on the device: the chunk's C nodes against the F fed before and
    themselves (:meth:`ChoiceTree.visible`)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        if self.info.rank != self.owner:
            return super().attend(layer, q, k, v, scale)
        assert self.visible is not None and self.signal is None
        if not self.cache.holds(layer):
            self.cache.store(layer, k[:, :0], v[:, :0])
        keys, values = self.cache.layer(layer)
        p = self.prompt[layer]
        held = kernels.attention(q, keys[:, :p], values[:, :p], causal=False, scale=scale,
                                 backend=self.kernel)
        among = masked_attention(q, torch.cat([keys[:, p:], k], dim=1),
                                 torch.cat([values[:, p:], v], dim=1), self.visible, scale)
        self.cache.append(layer, k, v)
        out, lse = merge_partials([held[0], among[0]], [held[1], among[1]])
        gathered = comm.all_gather(pack_partial(out, lse), self.info.group)
        return merge_packed(gathered)[0].to(q.dtype)


def score_choices(
    model: VideoModel,
    first_logits: torch.Tensor,
    choice_ids: list[list[int]],
    next_position: int,
    cache: RankKVCache,
    info: DistInfo,
    *,
    kernel: str | None = None,
) -> list[float]:
    """log p(choice | prompt) per choice: teacher-forced, exact, over the distributed cache, in
    one forward of the choices' tree (see the module docstring); single-token choices need
    none. Every rank feeds the same rows; the values come from the query rank, so every rank
    returns the same ones."""
    first = torch.log_softmax(first_logits.float(), dim=-1)
    device = first.device
    logprobs = first[torch.tensor([ids[0] for ids in choice_ids], device=device)].double()
    tree = choice_tree(choice_ids)
    n = len(tree.tokens)
    if n:
        if info.rank == QUERY_RANK:  # the nodes' rows, reserved once (kv_reserve)
            cache.make_room(n)
        scored = [(node, m, ids[j + 1]) for m, ids in enumerate(choice_ids)
                  for j, node in enumerate(tree.paths[m])]  # node's logits score ids[j + 1]
        mark = cache.lengths()
        try:
            with torch.inference_mode():
                for start in range(0, n, NODE_CHUNK):
                    end = min(n, start + NODE_CHUNK)
                    ctx = TreeContext(info, cache, kernel, prompt=mark,
                                      visible=tree.visible(start, end).to(device))
                    ids = torch.tensor(tree.tokens[start:end], device=device).view(1, -1)
                    positions = next_position + torch.tensor(tree.depths[start:end],
                                                             device=device)
                    with active(ctx):
                        hidden = model.decoder(model.embed(ids),
                                               positions.view(1, 1, -1).expand(3, 1, -1))
                    rows = torch.log_softmax(model.logits(hidden[0]).float(), dim=-1)
                    here = [(node - start, m, token) for node, m, token in scored
                            if start <= node < end]
                    if here:
                        at, who, token = (torch.tensor(x, device=device) for x in zip(*here))
                        logprobs.index_add_(0, who, rows[at, token].double())
        finally:
            cache.truncate(mark)
    return comm.broadcast_object(logprobs.tolist(), src=QUERY_RANK, group=info.group)
