"""Temporal pruning in the request path (``video.static_threshold`` or ``video.pruning_rate``
> 0; the rules: :mod:`apbv.video.prune`).

1. Preprocessing (:meth:`apbv.engine.engine.Engine.preprocess`) checks the request against the
   whole video's prompt (an upper bound of the pruned one), decodes this rank's frames as
   always and keeps them with their signatures as an :class:`Unpruned` share
   (:func:`unpruned_share`); no tower rows are made yet.
2. Once the ranks agree that preprocessing went well, :func:`agreed_keep` all-gathers the
   signatures (a collective, every rank alike) and applies the rules to the whole video's
   (the threshold's patches, then the rate's tokens among them), so every rank holds the
   same masks, whatever the number of ranks.
3. :func:`pruned_inputs` builds the prompt over the kept temporal patches (the family's text
   goes with them) and this rank's kept frames' tower rows; the frame split is counted in
   kept patches (a rank may keep none: it encodes nothing and receives its tokens' rows).
   With a rate, the prompt is the one of the kept patches, whole, less the placeholders of
   the pruned tokens, and its positions are that whole prompt's at the tokens that stay
   (:func:`drop_tokens`): for every family, a kept patch is laid out as if whole, its pruned
   tokens leaving their positions unused. The tower still encodes the kept patches whole;
   the runner drops the pruned rows after it (:attr:`PromptInputs.kept_tokens`).

The vision cache is not used with pruning (its entries hold a whole share's embeddings, and
a hit skips the decoding the masks are computed from).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from apbv import comm
from apbv.engine.request import PromptInputs, Request
from apbv.model.adapter import VideoModel
from apbv.plan import Range
from apbv.video import RankFrames, Sampling
from apbv.video.prune import keep_mask, kept_split, prune_tokens, signatures, token_mask


@dataclass(frozen=True)
class Unpruned:
    """A rank's decoded share of a video, before the ranks agree on what stays."""

    frames: torch.Tensor
    """uint8 (F, 3, H, W): this rank's frames (the whole video when the vision work is not
    split), as decoded and resized for the tower."""
    signatures: torch.Tensor
    """(F / unit, 3, gh, gw) float32: their temporal patches' signatures."""
    sampling: Sampling
    patch_ranges: tuple[Range, ...]
    """The frame split over the whole video's patches (every rank (0, t) when not split)."""
    split: bool
    """Whether the ranks encode disjoint shares (else every rank holds every frame)."""
    rank: int
    choice_ids: list[list[int]] | None
    snapped: tuple[tuple[int, int, int], ...] | None


def unpruned_share(model: VideoModel, frames: RankFrames, patch_ranges: tuple[Range, ...], *,
                   split: bool, rank: int, choice_ids: list[list[int]] | None,
                   snapped: tuple[tuple[int, int, int], ...] | None) -> Unpruned:
    """This rank's decoded ``frames`` with their signatures over the family's merged-patch
    grid (one cell per LLM token of a frame)."""
    _, h, w = model.video_grid(frames.sampling)
    merge = model.spatial_merge_size
    sigs = signatures(frames.frames, frames.sampling.temporal_patch_size,
                      (h // merge, w // merge))
    return Unpruned(frames.frames, sigs, frames.sampling, patch_ranges, split, rank, choice_ids,
                    snapped)


@dataclass(frozen=True)
class Kept:
    """What stays of a video, the same on every rank."""

    patches: list[bool]
    """Per temporal patch of the whole video, whether any of its tokens stays."""
    tokens: torch.Tensor | None
    """(sum(patches), S) bool: per kept patch, which of its S tokens stay (row-major over the
    merged grid); None without a rate (all of them)."""


def agreed_keep(share: Unpruned, threshold: float, rate: float,
                group: dist.ProcessGroup | None) -> Kept:
    """What stays of the whole video at ``threshold`` (0: every patch in play) and ``rate``
    (0: every token of those), the same on every rank (one all-gather of the signatures when
    the vision work is split; call on every rank alike)."""
    sigs = share.signatures
    if share.split:
        counts = [p1 - p0 for p0, p1 in share.patch_ranges]
        sigs = comm.all_gather_rows(sigs, counts, group)
    keep = keep_mask(sigs, threshold) if threshold > 0 else [True] * len(sigs)
    if rate == 0:
        return Kept(keep, None)
    return Kept(*prune_tokens(keep, token_mask(sigs, keep, rate)))


def drop_tokens(model: VideoModel, context_ids: torch.Tensor, positions: torch.Tensor,
                tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(context ids (N',), positions (3, 1, N' + Q)) of a prompt whose video tokens are
    ``tokens`` (K, S) of the whole kept patches: the prompt ``context_ids`` (N,) over those
    patches whole, with ``positions`` (3, 1, N + Q) (the family's rule), less the pruned
    tokens' placeholders and their positions."""
    is_video = torch.zeros(positions.shape[-1], dtype=torch.bool)
    is_video[:len(context_ids)] = context_ids == model.video_token_id
    assert int(is_video.sum()) == tokens.numel(), (int(is_video.sum()), tokens.shape)
    stay = torch.ones_like(is_video)
    stay[is_video] = tokens.flatten().cpu()
    return context_ids[stay[:len(context_ids)]], positions[..., stay]


def pruned_inputs(model: VideoModel, request: Request, share: Unpruned,
                  keep: Kept) -> PromptInputs:
    """The request's :class:`PromptInputs` over the ``keep`` temporal patches (and tokens):
    the pruned prompt (with its positions when tokens are dropped), this rank's kept frames'
    tower rows (None when it keeps none) and the frame split in kept patches."""
    kept, ranges = kept_split(keep.patches, share.patch_ranges)
    grid = model.video_grid(share.sampling)
    context_ids, query_ids = model.prompt(request.question, grid, request.system,
                                          sampling=share.sampling, kept=kept)
    positions = None
    if keep.tokens is not None:
        whole = model.positions(torch.cat([context_ids, query_ids]), grid,
                                share.sampling.second_per_grid_t, kept)
        context_ids, positions = drop_tokens(model, context_ids, whole, keep.tokens)
    p0, p1 = share.patch_ranges[share.rank]
    unit = share.sampling.temporal_patch_size
    mine = torch.tensor(keep.patches[p0:p1], dtype=torch.bool).repeat_interleave(unit)
    frames = share.frames[mine.to(share.frames.device)]
    pixel_values = None
    if len(frames):
        pixel_values, local_grid = model.tower_rows(frames)
        assert local_grid == (ranges[share.rank][1] - ranges[share.rank][0], *grid[1:]), \
            (local_grid, ranges, share.rank)
    return PromptInputs(
        context_ids=context_ids,
        query_ids=query_ids,
        video_grid=grid,
        second_per_grid_t=share.sampling.second_per_grid_t,
        patch_ranges=ranges,
        pixel_values=pixel_values,
        num_frames=share.sampling.num_frames,
        choice_ids=share.choice_ids,
        snapped=share.snapped,
        kept=kept,
        kept_tokens=keep.tokens,
        positions=positions,
    )
