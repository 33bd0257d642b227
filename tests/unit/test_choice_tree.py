"""The tree of closed-vocabulary choices scored in one forward
(:mod:`apbv.engine.choice_tree`): a shared prefix is one node, each node sees itself and its
ancestors only, each choice's tokens are scored by the nodes of its own prefixes; and the
masked attention of the nodes equals plain attention of each node's path. (That the scores
equal a single-process forward's is checked on 1 and 2 ranks by
``tests/multirank/test_choices_multirank.py``.)"""

from __future__ import annotations

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
