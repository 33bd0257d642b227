"""The tree of closed-vocabulary choices scored in one forward
(:mod:`apbv.engine.choice_tree`): a shared prefix is one node, each node sees itself and its
ancestors only, each choice's tokens are scored by the nodes of its own prefixes; and the
masked attention of the nodes equals plain attention of each node's path; the scores, fed in
one forward or in chunks, equal a plain causal forward's on a one-layer toy decoder. (That they
equal transformers' on the tiny model on 1 and 2 ranks is
``tests/multirank/test_choices_multirank.py``.)"""

from __future__ import annotations

import pytest
import torch

from apbv.attention import kernels
from apbv.engine.choice_tree import choice_tree, kv_reserve, masked_attention


def test_a_shared_prefix_is_one_node_and_rows_see_only_their_ancestors():
    # "blue" and "black" share "bl"; a single-token choice needs no node
    tree = choice_tree([[1, 2, 3, 4], [1, 2, 5, 6, 7], [9], [8, 3]])
    assert tree.tokens == [1, 2, 3, 5, 6, 8]
    assert tree.depths == [0, 1, 2, 2, 3, 0]
    assert tree.paths == [[0, 1, 2], [0, 1, 3, 4], [], [5]]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for row, seen in {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 1, 3], 4: [0, 1, 3, 4],
                      5: [5]}.items():
        expected[row, seen] = True
    assert torch.equal(tree.visible(0, 6), expected)
    assert torch.equal(tree.visible(2, 5), expected[2:5, :5])  # a chunk of the nodes


def test_masked_attention_of_a_node_is_the_causal_attention_of_its_path():
    g = torch.Generator().manual_seed(0)
    tree = choice_tree([[1, 2, 3, 4], [1, 2, 5, 6, 7], [8, 3]])
    n = len(tree.tokens)
    q = torch.randn(1, n, 4, 8, generator=g)  # 4 query heads over 2 KV heads
    k, v = torch.randn(1, n, 2, 8, generator=g), torch.randn(1, n, 2, 8, generator=g)
    out, lse = masked_attention(q, k, v, tree.visible(0, n), 0.35)
    for path in tree.paths:
        rows = torch.tensor(path)
        want, want_lse = kernels.attention(q[:, rows], k[:, rows], v[:, rows], causal=True,
                                           scale=0.35, backend="reference")
        torch.testing.assert_close(out[:, rows], want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse[:, :, rows], want_lse, rtol=1e-5, atol=1e-6)


def test_the_cache_reserves_the_tree_s_rows():
    assert kv_reserve(7, None) == 7  # no choices: the decode's tokens
    assert kv_reserve(7, [[1, 2, 3, 4], [1, 2, 5, 6, 7], [8, 3]]) == 6  # 6 nodes > 5 tokens
    assert kv_reserve(7, [[1, 2, 3, 4, 5, 6], [9]]) == 6  # a single chain: its length


class _Toy:
    """A one-layer decoder through apbv's attention hook (positions added to the embeddings):
    enough for teacher-forced choice scores to be checked against a plain causal forward."""

    def __init__(self, vocab: int = 16, width: int = 8) -> None:
        g = torch.Generator().manual_seed(1)
        self.table = torch.randn(vocab, width, generator=g)
        self.pos = torch.randn(64, width, generator=g)
        self.wq, self.wk, self.wv, self.head = (torch.randn(width, width, generator=g)
                                                for _ in range(4))
        self.head = torch.randn(width, vocab, generator=g)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]

    def decoder(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        from apbv.context import current

        x = embeds + self.pos[positions[0]]  # (1, T, W)
        q, k, v = ((x @ w).view(1, -1, 2, 4) for w in (self.wq, self.wk, self.wv))
        return x + current().attend(0, q, k, v, 0.5).reshape(x.shape)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.head

    def plain(self, ids: list[int]) -> torch.Tensor:
        """(T, vocab) log-probabilities of a plain causal forward over ``ids``."""
        x = self.embed(torch.tensor(ids)).unsqueeze(0) + self.pos[:len(ids)]
        q, k, v = ((x @ w).view(1, -1, 2, 4) for w in (self.wq, self.wk, self.wv))
        out, _ = kernels.attention(q, k, v, causal=True, scale=0.5, backend="reference")
        return torch.log_softmax(self.logits(x + out.reshape(x.shape))[0], dim=-1)


def test_choice_scores_in_chunks_equal_a_plain_forward(monkeypatch):
    from apbv.context import active
    from apbv.distributed import DistInfo
    from apbv.engine import choice_tree as tree_module
    from apbv.engine.decode import DecodeContext
    from apbv.engine.kvcache import RankKVCache

    toy, prompt = _Toy(), [3, 1, 4, 1, 5]
    choices = [[9, 2, 6], [9, 2, 6, 5, 3], [9, 7], [8], [2, 6, 5, 3, 5]]
    info = DistInfo(0, 1, 0, torch.device("cpu"), None)
    want = []
    for ids in choices:
        rows = toy.plain(prompt + ids)
        want.append(sum(float(rows[len(prompt) - 1 + j, t]) for j, t in enumerate(ids)))
    for chunk in (128, 3, 1):  # one forward; chunks cutting through the tree
        monkeypatch.setattr(tree_module, "NODE_CHUNK", chunk)
        cache = RankKVCache(1, reserve=0)
        with torch.inference_mode(), active(DecodeContext(info, cache, None, owner=0)):
            hidden = toy.decoder(toy.embed(torch.tensor([prompt])),
                                 torch.arange(len(prompt)).expand(3, 1, -1))
        got = tree_module.score_choices(toy, toy.logits(hidden[0, -1]), choices, len(prompt),
                                        cache, info)
        assert cache.lengths() == (len(prompt),)  # the prompt's again
        assert got == pytest.approx(want, rel=1e-5), chunk
