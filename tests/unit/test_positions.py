"""apbv.positions: the trained M-RoPE rule, checked against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from apbv.layout import shard, unshard
from apbv.plan import make_plan
from apbv.positions import mrope_positions, video_token_runs

V = 99  # video placeholder id in these tests


def test_hand_computed_text_video_text() -> None:
    # 2 text tokens, a video of t=3 temporal patches on a 4x4 patch grid (2x2 after merging),
    # then 3 text tokens. 1 s per temporal patch at 2 tokens/s: temporal ids step by 2.
    ids = torch.tensor([1, 2] + [V] * 12 + [3, 4, 5])
    pos = mrope_positions(ids, [(3, 4, 4)], [1.0], video_token_id=V, spatial_merge_size=2,
                          tokens_per_second=2)
    assert pos.shape == (3, 1, 17)
    t, h, w = pos[:, 0].tolist()
    assert t[:2] == h[:2] == w[:2] == [0, 1]
    assert t[2:14] == [2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6]
    assert h[2:14] == [2, 2, 3, 3] * 3
    assert w[2:14] == [2, 3, 2, 3] * 3
    # Text resumes at max + 1 = 7 (transformers 5.24 would resume at 2 + 2 = 4).
    assert t[14:] == h[14:] == w[14:] == [7, 8, 9]


def test_fractional_seconds_floor_and_two_videos() -> None:
    ids = torch.tensor([7] + [V] * 3 + [8] + [V] * 2)
    pos = mrope_positions(ids, [(3, 2, 2), (2, 2, 2)], [0.75, 2.5], video_token_id=V,
                          spatial_merge_size=2, tokens_per_second=2)
    t, h, w = pos[:, 0].tolist()
    # Video 1 at offset 1: temporal floor(g * 1.5) = 0, 1, 3 -> 1, 2, 4; h = w = 1.
    assert t[1:4] == [1, 2, 4] and h[1:4] == w[1:4] == [1, 1, 1]
    assert t[4] == h[4] == w[4] == 5
    # Video 2 at offset 6: temporal floor(g * 5) = 0, 5.
    assert t[5:] == [6, 11] and h[5:] == w[5:] == [6, 6]


def test_positions_shard_with_tokens() -> None:
    ids = torch.tensor([1] * 5 + [V] * 48 + [2] * 9)
    pos = mrope_positions(ids, [(3, 8, 8)], [1.0], video_token_id=V, spatial_merge_size=2,
                          tokens_per_second=2)
    plan = make_plan(56, 6, 3)
    locals_ = [shard(pos, plan, r, dim=2) for r in range(3)]
    assert torch.equal(unshard(locals_, plan, dim=2), pos)
    for r in range(3):
        local_ids = shard(ids.unsqueeze(0), plan, r)[0]
        assert torch.equal(local_ids, ids[torch.cat([torch.arange(s, e) for s, e in
                                                      plan.global_ranges(r)])])


def test_errors() -> None:
    ids = torch.tensor([1] + [V] * 4)
    with pytest.raises(ValueError, match="the prompt has 1 video"):
        mrope_positions(ids, [], [], video_token_id=V, spatial_merge_size=2, tokens_per_second=2)
    with pytest.raises(ValueError, match=r"video tokens \[1, 5\) are 4 but the grid 2x2x2"):
        mrope_positions(ids, [(2, 2, 2)], [1.0], video_token_id=V, spatial_merge_size=2,
                        tokens_per_second=2)
    assert video_token_runs(torch.tensor([V, 1, V, V]), V) == [(0, 1), (2, 4)]


class _RecordQK:
    """An attention context that keeps each layer's post-RoPE q and k and attends nothing
    (zeros), so every layer's pre-RoPE q and k depend on the embeddings only."""

    def __init__(self) -> None:
        self.qk: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attend(self, layer, q, k, v, scale):
        self.qk.append((q.clone(), k.clone()))
        return torch.zeros_like(q)


def test_rope_shift_leaves_the_attention_scores_unchanged(tiny_model_dir) -> None:
    """Keys rotated by the model's own M-RoPE at positions P, moved by rope_shift(-S), give
    the scores of queries at P - S that the unshifted keys gave at P (every layer)."""
    from apbv.context import active
    from apbv.model.qwen2_5_vl.adapter import load
    from apbv.positions import rope_shift

    model = load(tiny_model_dir, device=torch.device("cpu"), dtype=torch.float32)
    ids = torch.tensor([1, 2] + [V] * 12 + [3, 4, 5])
    positions = mrope_positions(ids, [(3, 4, 4)], [1.0], video_token_id=V, spatial_merge_size=2,
                                tokens_per_second=2) + 5000  # a stream far into its range
    shift = 4990
    embeds = torch.randn(1, len(ids), model.text_config.hidden_size,
                         generator=torch.Generator().manual_seed(0))
    runs = []
    for pos in (positions, positions - shift):
        ctx = _RecordQK()
        with torch.inference_mode(), active(ctx):
            model.decoder(embeds, pos)
        runs.append(ctx.qk)
    worst = 0.0
    for (q_far, k_far), (q_near, k_near) in zip(*runs):
        moved = rope_shift(k_far, -shift, model.rope_inv_freq)
        group = q_far.shape[2] // k_far.shape[2]
        k_rep = moved.repeat_interleave(group, dim=2)
        before = torch.einsum("bqhd,bkhd->bhqk", q_far, k_far.repeat_interleave(group, dim=2))
        after = torch.einsum("bqhd,bkhd->bhqk", q_near, k_rep)
        worst = max(worst, float((before - after).abs().max() / before.abs().max()))
        key_err = float((moved - k_near).abs().max() / k_near.abs().max())
        assert key_err <= 1e-3, f"moved keys differ from keys at P - S by {key_err:.2e} > 1e-3"
    # The model's fp32 cos/sin of angles up to 5000 rad carry about 5000 * 6e-8 = 3e-4 rad of
    # error (relative), so 1e-3 of the largest score.
    assert worst <= 1e-3, f"scores moved by {worst:.2e} (relative to the largest) > 1e-3"
    print(f"\nscores after rope_shift: max relative change {worst:.2e}")
