"""3-D M-RoPE position ids of a Qwen2.5-VL prompt, computed once on the global prompt (pure).

Text tokens get (p, p, p) with p counting up. The tokens of a video with an LLM grid of
(t, h, w) (after the 2x2 spatial merge) starting at offset s get

    temporal = s + floor(g * second_per_grid_t * tokens_per_second)   for temporal patch g
    height   = s + y,   width = s + x

and the text after the video resumes at max(all positions so far) + 1.

That resume rule is the one of Qwen's reference implementation and of transformers 4.x, which
the released Qwen2.5-VL checkpoints were trained and evaluated with. transformers 5.24's
``get_rope_index`` instead resumes at s + max(h, w); the two agree only when the video's
temporal extent is not larger than its spatial one, so long videos differ. We keep the
trained rule and pass explicit position ids to the model everywhere.

Decode step i (0-based, after a prompt of length L) uses max(prompt positions) + 1 + i on all
three axes.

A live stream moves every cached position by the same amount on all three axes when its
positions would leave the model's trained range (:func:`rope_shift`): RoPE scores depend only
on position differences per axis, so the attention is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def video_token_runs(input_ids: torch.Tensor, video_token_id: int) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of video placeholder tokens in a 1-D id tensor."""
    is_video = (input_ids == video_token_id).tolist()
    runs = []
    start = None
    for i, flag in enumerate(is_video + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs


def video_positions(patches: Sequence[int], gh: int, gw: int, seconds_per_patch: float,
                    tokens_per_second: float, offset: int) -> torch.Tensor:
    """(3, len(patches) * gh * gw) int64 M-RoPE positions of video tokens: temporal patch
    ``g`` at ``floor(g * seconds_per_patch * tokens_per_second)``, rows and columns of the
    merged (gh, gw) grid, all plus ``offset``."""
    temporal = torch.tensor(
        [math.floor(g * seconds_per_patch * tokens_per_second) for g in patches],
        dtype=torch.long,
    )
    grid_t, grid_h, grid_w = torch.meshgrid(
        temporal, torch.arange(gh), torch.arange(gw), indexing="ij"
    )
    return torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + offset


def mrope_positions(
    input_ids: torch.Tensor,
    video_grids: Sequence[tuple[int, int, int]],
    second_per_grid_ts: Sequence[float],
    *,
    video_token_id: int,
    spatial_merge_size: int,
    tokens_per_second: float,
    kept: Sequence[Sequence[int] | None] | None = None,
) -> torch.Tensor:
    """Position ids (3, 1, L) int64 for a 1-D prompt ``input_ids`` (L,).

    Args:
        video_grids: per video, its (t, h, w) patch grid as given by the processor
            (``video_grid_thw``; h and w before the spatial merge).
        second_per_grid_ts: per video, seconds covered by one temporal patch
            (temporal_patch_size / sampled fps).
        kept: per video, the temporal patches of its grid that the prompt holds (temporal
            pruning: each keeps the positions it has in the whole video), or None for all.
    """
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be 1-D (L,), got shape {tuple(input_ids.shape)}")
    runs = video_token_runs(input_ids, video_token_id)
    if len(runs) != len(video_grids) or len(video_grids) != len(second_per_grid_ts):
        raise ValueError(
            f"the prompt has {len(runs)} video(s) but {len(video_grids)} grid(s) and "
            f"{len(second_per_grid_ts)} time step(s) were given"
        )
    pieces = []
    next_pos = 0
    cursor = 0
    for i, ((start, end), (t, h, w), seconds) in enumerate(zip(runs, video_grids,
                                                               second_per_grid_ts)):
        held = None if kept is None else kept[i]
        patches: Sequence[int] = range(t) if held is None else held
        t = len(patches)
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        if end - start != t * gh * gw:
            raise ValueError(
                f"video tokens [{start}, {end}) are {end - start} but the grid {t}x{h}x{w} "
                f"with merge {spatial_merge_size} needs {t * gh * gw}"
            )
        text = torch.arange(start - cursor) + next_pos
        pieces.append(text.expand(3, -1))
        video = video_positions(patches, gh, gw, seconds, tokens_per_second,
                                next_pos + start - cursor)
        pieces.append(video)
        next_pos = int(video.max()) + 1
        cursor = end
    pieces.append((torch.arange(input_ids.numel() - cursor) + next_pos).expand(3, -1))
    return torch.cat(pieces, dim=1).unsqueeze(1)


def rope_shift(keys: torch.Tensor, shift: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys (..., D) rotated by (M-)RoPE at their positions -> the same keys at every position
    plus ``shift`` on all three axes (transformers' half-split layout: frequency i rotates the
    pair (i, i + D/2) by position * inv_freq[i]; ``inv_freq`` is (D/2,)).

    Moving all axes alike rotates every frequency by ``shift * inv_freq[i]`` whichever axis
    its M-RoPE section reads, so the rotation composes exactly; angles in float64.
    """
    assert keys.shape[-1] == 2 * inv_freq.numel(), (keys.shape, inv_freq.shape)
    angle = shift * inv_freq.to(torch.float64)
    cos = torch.cat([angle.cos(), angle.cos()]).to(torch.float32).to(keys.device)
    sin = torch.cat([angle.sin(), angle.sin()]).to(torch.float32).to(keys.device)
    x = keys.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(keys.dtype)
