"""Closed-vocabulary choices scored in one forward over the distributed cache: the choices'
tokens as a tree (a prefix two choices share is one node), every node fed at once, each row
attending exactly to the whole cache and to its own ancestors in the tree.

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
from apbv.engine.decode import DecodeContext
from apbv.engine.kvcache import RankKVCache
from apbv.model.adapter import VideoModel
from apbv.plan import QUERY_RANK


@dataclass(frozen=True)
class ChoiceTree:
    """The nodes fed to score choices: every distinct prefix of a choice but the whole one."""

    tokens: list[int]
    """(N,) the token each node feeds (the last of its prefix)."""
    depths: list[int]
    """(N,) the index of that token in its choices (the node's position after the prompt)."""
    visible: torch.Tensor
    """(N, N) bool: row r attends node c (c is r or one of r's ancestors)."""
    paths: list[list[int]]
    """Per choice, the node feeding each of its tokens but the last (len(choice) - 1)."""


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
    visible = torch.zeros(len(tokens), len(tokens), dtype=torch.bool)
    for row in range(len(tokens)):
        node = row
        while node >= 0:
            visible[row, node] = True
            node = parents[node]
    paths = [[index[tuple(ids[:j + 1])] for j in range(len(ids) - 1)] for ids in choice_ids]
    return ChoiceTree(tokens, depths, visible, paths)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows q (1, T, Hq, D) over k/v (1, T, Hkv, D) where ``visible`` (T, T) bool allows (every
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
    """:class:`DecodeContext` of a tree's nodes: the owner attends them to everything it held
    before them and to their ancestors among them (``visible``), then keeps their KV; every
    other rank attends them to all it holds. The partials are merged by log-sum-exp."""

    visible: torch.Tensor | None = None
    """(N, N) bool on the device (:attr:`ChoiceTree.visible`)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        if self.info.rank != self.owner:
            return super().attend(layer, q, k, v, scale)
        assert self.visible is not None and self.signal is None
        if not self.cache.holds(layer):
            self.cache.store(layer, k[:, :0], v[:, :0])
        keys, values = self.cache.layer(layer)
        held = kernels.attention(q, keys, values, causal=False, scale=scale,
                                 backend=self.kernel)
        among = masked_attention(q, k, v, self.visible, scale)
        self.cache.append(layer, k, v)
        out, lse = merge_partials([held[0], among[0]], [held[1], among[1]])
        gathered = comm.all_gather(pack_partial(out, lse), self.info.group)
        return merge_packed(gathered)[0].to(q.dtype)


def score_choices(
    qwen: VideoModel,
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
    if tree.tokens:
        mark = cache.lengths()
        ctx = TreeContext(info, cache, kernel, visible=tree.visible.to(device))
        ids = torch.tensor(tree.tokens, device=device).view(1, -1)
        positions = (next_position + torch.tensor(tree.depths, device=device)).view(1, 1, -1)
        try:
            with torch.inference_mode(), active(ctx):
                hidden = qwen.decoder(qwen.embed(ids), positions.expand(3, 1, -1))
                rows = torch.log_softmax(qwen.logits(hidden[0]).float(), dim=-1)  # (N, vocab)
        finally:
            cache.truncate(mark)
        for m, ids_m in enumerate(choice_ids):
            for j, node in enumerate(tree.paths[m]):
                logprobs[m] += rows[node, ids_m[j + 1]]
    return comm.broadcast_object(logprobs.tolist(), src=QUERY_RANK, group=info.group)
