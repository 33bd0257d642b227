"""apbv.attention.select: scores, pooling inside a block, top-k with the stated tie rules."""

from __future__ import annotations

import torch

from apbv.attention.select import block_scores, mean_query, pack_selection, select_tokens


def test_mean_query_groups_consecutive_heads():
    q = torch.zeros(1, 2, 4, 3)
    q[0, :, 0], q[0, :, 1] = 1.0, 3.0  # group of KV head 0
    q[0, 0, 2], q[0, 1, 3] = 4.0, 8.0  # group of KV head 1
    qbar = mean_query(q, num_kv_heads=2)
    assert qbar.dtype == torch.float32
    assert torch.equal(qbar, torch.tensor([[2.0] * 3, [3.0] * 3]))


def test_pooling_stays_inside_the_block():
    raw = torch.tensor([1.0, 5.0, 2.0, 0.0, 0.0, 0.0, 9.0])
    k = raw.view(7, 1, 1)
    got_raw, pooled = block_scores(k, torch.ones(1, 1))
    assert torch.equal(got_raw[:, 0], raw)
    assert pooled[:, 0].tolist() == [5.0, 5.0, 5.0, 5.0, 9.0, 9.0, 9.0]


def test_ties_broken_by_raw_then_position():
    # Pooled scores tie for positions 0..4; raw decides (3 > 1), then position (2 before 4).
    raw = torch.tensor([[0.0], [1.0], [0.5], [3.0], [0.5], [-9.0]])
    pooled = torch.tensor([[7.0], [7.0], [7.0], [7.0], [7.0], [1.0]])
    assert select_tokens(raw, pooled, 2)[:, 0].tolist() == [1, 3]
    assert select_tokens(raw, pooled, 3)[:, 0].tolist() == [1, 2, 3]
    assert select_tokens(raw, pooled, 0).shape == (0, 1)
    assert select_tokens(raw, pooled, 6)[:, 0].tolist() == list(range(6))


def test_each_kv_head_selects_its_own_tokens():
    raw = torch.tensor([[0.0, 9.0], [5.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0],
                        [0.0, 0.0], [0.0, 0.0], [7.0, 0.0]])
    _, pooled = block_scores(raw.unsqueeze(-1), torch.ones(2, 1))
    idx = select_tokens(raw, pooled, 2)
    # Head 0: pooled ties at 7 for positions 5..7; raw picks 7, then the earliest (5).
    assert idx[:, 0].tolist() == [5, 7] and idx[:, 1].tolist() == [0, 1]


def test_pack_selection_layout_and_padding():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(10, 2, 4, generator=g)
    v = torch.randn(10, 2, 4, generator=g)
    qbar = torch.randn(2, 4, generator=g)
    buf = pack_selection(k, v, qbar, count=3, capacity=5)
    assert buf.shape == (2, 5, 2, 4)
    idx = select_tokens(*block_scores(k, qbar), 3)
    for h in range(2):
        assert torch.equal(buf[0, :3, h], k[idx[:, h], h])
        assert torch.equal(buf[1, :3, h], v[idx[:, h], h])
    assert torch.equal(buf[:, 3:], torch.zeros(2, 2, 2, 4))
    whole = pack_selection(k, v, qbar, count=10, capacity=10)
    assert torch.equal(whole[0], k) and torch.equal(whole[1], v)
    assert torch.equal(pack_selection(k, v, qbar, 0, 2), torch.zeros(2, 2, 2, 4))
