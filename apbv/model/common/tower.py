"""Qwen2.5-VL's vision tower as apbv runs it: module set-up and chunked runs.

The vision tower's attention is registered with transformers
(:data:`apbv.model.common.hook.VISION_ATTN_IMPLEMENTATION`,
:mod:`apbv.model.common.vision_attention`):
equal-size windows batched into one call per size, or a varlen kernel on CUDA;
``vision.attention=per_window`` keeps the stock SDPA path. The patch embedding runs as one
matrix product (:mod:`apbv.model.common.patch_embed`; ``vision.patch_embed=conv`` keeps the stock
Conv3d), the q/k rotary runs on q and k together (``vision.rotary``), on CUDA the RMSNorms run
as one kernel and the MLPs are padded to an aligned width (``vision.norm``, ``vision.mlp_pad``;
:mod:`apbv.model.common.vision_blocks`), and the tower runs a few temporal patches per call on CPU
(``vision.chunk_rows``; every vision block attends inside one temporal patch, so the chunks are
independent). :func:`set_tower` applies these.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import types
from collections.abc import Generator, Iterable
from typing import TYPE_CHECKING, Any

import torch
from transformers import Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

from apbv.config import PATCH_EMBED, VISION_ATTENTION, VISION_NORM, VISION_ROTARY
from apbv.model.common.hf_compat import module_function
from apbv.model.common.hook import VISION_ATTN_IMPLEMENTATION, register_attention
from apbv.model.common.patch_embed import linear_patch_embed
from apbv.model.common.vision_attention import fused_rotary
from apbv.model.common.vision_blocks import CUDA_MLP_PAD, fused_rms_norm, pad_mlp
from apbv.validate import one_of
from apbv.video.patches import PatchSpec, patches_per_chunk

if TYPE_CHECKING:
    from apbv.config import VisionConfig

CPU_CHUNK_ROWS = 8192
"""``vision.chunk_rows`` left unset: patch rows per vision-tower call on CPU (whole temporal
patches; the activations of a call stay in cache, which made the tower 8-20% faster than one
call for the video in benchmarks/bench_vision.py); on other devices the video goes in one
call, as fewer, larger kernels are what a GPU needs."""


def set_vision_attention(model: Qwen2_5_VLForConditionalGeneration, name: str) -> None:
    """Select the vision tower's attention: ``grouped`` (one call per window size, or one
    varlen call on CUDA) or ``per_window`` (the stock SDPA path, one call per window)."""
    one_of("vision.attention", name, VISION_ATTENTION)
    register_attention()
    config = model.model.visual.config
    config._attn_implementation = VISION_ATTN_IMPLEMENTATION if name == "grouped" else "sdpa"


def set_vision_rotary(name: str) -> None:
    """Select how the vision tower applies its q/k rotary: ``fused`` (q and k in one set of
    passes, bit-equal to transformers', :func:`apbv.model.common.vision_attention.fused_rotary`) or
    ``stock``. transformers looks the function up in its modeling module at every call, so
    the choice holds for the whole process; both give bit-equal values, so models of one
    process never compute different numbers because of it, only at a different speed."""
    one_of("vision.rotary", name, VISION_ROTARY)
    current_fn = module_function(modeling_qwen2_5_vl, "apply_rotary_pos_emb_vision")
    if current_fn is None:  # a version without the module-level function (hf_compat)
        return
    stock = getattr(current_fn, "stock", current_fn)
    modeling_qwen2_5_vl.apply_rotary_pos_emb_vision = \
        fused_rotary(stock) if name == "fused" else stock


def tower_chunks(grid: torch.Tensor, chunk_rows: int) -> list[tuple[int, int, torch.Tensor]]:
    """The vision-tower calls for patch rows of ``grid`` ((n, 3) rows of (t, h, w)): (first
    row, end row, the call's grid) each. ``chunk_rows`` > 0: whole temporal patches of one
    grid row, at most ``chunk_rows`` patch rows per call (at least one temporal patch);
    0: one call for everything."""
    total = int(grid.prod(dim=1).sum())
    if chunk_rows <= 0:
        return [(0, total, grid)]
    calls, row = [], 0
    for t, h, w in grid.tolist():
        step = patches_per_chunk(h * w, chunk_rows)
        for first in range(0, t, step):
            n = min(step, t - first)
            calls.append((row, row + n * h * w, torch.tensor([[n, h, w]])))
            row += n * h * w
    return calls


def rows_in_worker(process: Any, chunks: Iterable[torch.Tensor],
                   device: torch.device | None = None,
                   ) -> Generator[tuple[torch.Tensor, tuple[int, int, int]], None, None]:
    """``process(chunk)`` for each chunk, run ahead by one in a worker thread: the next
    chunk's rows are made while the caller uses the current ones (at most one waits). An
    error in the worker is raised here; closing the generator stops and joins the worker.

    On a CUDA ``device`` the worker's device work (a chunk's decoding or resizing there, its
    rows' upload) runs on a stream of its own, so it overlaps the caller's tower kernels: the
    caller's stream waits for each chunk's event, and its rows are marked as used there (the
    caching allocator then keeps their memory until the caller's work on them is done)."""
    ready: queue.Queue[Any] = queue.Queue(maxsize=1)
    stop, end = threading.Event(), object()
    side = torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None

    def hand_over(item: Any) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            if side is not None:
                torch.cuda.set_device(side.device)  # the current device is per thread
            with contextlib.nullcontext() if side is None else torch.cuda.stream(side):
                for chunk in chunks:
                    rows = process(chunk)
                    done = None if side is None else side.record_event()
                    if not hand_over((rows, done)):
                        return
            hand_over(end)
        except BaseException as exc:  # raised in the caller's thread
            hand_over(exc)

    worker = threading.Thread(target=produce, name="apbv-frames", daemon=True)
    worker.start()
    try:
        while (item := ready.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            rows, done = item
            if done is not None and side is not None:
                current = torch.cuda.current_stream(side.device)
                current.wait_event(done)
                if rows[0].is_cuda:  # the patch rows (the grid is a tuple of ints)
                    rows[0].record_stream(current)
            yield rows
    finally:
        stop.set()
        worker.join()


def set_patch_embed(model: Qwen2_5_VLForConditionalGeneration, name: str) -> None:
    """Select the vision tower's patch embedding: ``linear`` (one matrix product,
    :mod:`apbv.model.common.patch_embed`; it also takes pixel levels) or ``conv`` (the stock
    Conv3d).
    Only this instance changes."""
    one_of("vision.patch_embed", name, PATCH_EMBED)
    _swap_forward(model.model.visual.patch_embed, linear_patch_embed if name == "linear" else None)


def set_vision_norm(model: Qwen2_5_VLForConditionalGeneration, name: str) -> None:
    """Select the vision tower's RMSNorms (its blocks' and the merger's): ``fused``
    (:func:`apbv.model.common.vision_blocks.fused_rms_norm`: one kernel on CUDA) or ``stock``. Only
    this instance changes."""
    one_of("vision.norm", name, VISION_NORM)
    visual = model.model.visual
    for norm in [visual.merger.ln_q, *(n for b in visual.blocks for n in (b.norm1, b.norm2))]:
        _swap_forward(norm, fused_rms_norm if name == "fused" else None)


def _swap_forward(module: torch.nn.Module, forward: Any) -> None:
    """Give this ``module`` instance ``forward(module, *args)`` as its forward, or (None) its
    class's forward back."""
    if forward is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = types.MethodType(forward, module)


def set_tower(model: Qwen2_5_VLForConditionalGeneration, vision: VisionConfig,
              device: torch.device) -> None:
    """Set up the vision tower of ``model`` (a Qwen2.5-VL model, on ``device``) as ``vision``
    says: its attention (:func:`set_vision_attention`), patch embedding
    (:func:`set_patch_embed`), q/k rotary (:func:`set_vision_rotary`, for the whole process),
    RMSNorms (:func:`set_vision_norm`) and MLP width
    (:func:`apbv.model.common.vision_blocks.pad_mlp`;
    ``mlp_pad`` unset: padded on CUDA only)."""
    visual = model.model.visual
    set_vision_attention(model, vision.attention)
    set_patch_embed(model, vision.patch_embed)
    set_vision_rotary(vision.rotary)
    set_vision_norm(model, vision.norm)
    pad_mlp(visual, vision.mlp_pad if vision.mlp_pad is not None
            else CUDA_MLP_PAD if device.type == "cuda" else 0)


def patch_spec(video_processor: Any) -> PatchSpec | None:
    """The processor's settings for :func:`apbv.video.patches.patch_rows`, or None when it
    does something else than rescale + normalise (then the processor itself runs)."""
    vp = video_processor
    if not (getattr(vp, "do_rescale", False) and getattr(vp, "do_normalize", False)):
        return None
    mean, std = vp.image_mean, vp.image_std
    if not (isinstance(mean, (list, tuple)) and len(mean) == 3
            and isinstance(std, (list, tuple)) and len(std) == 3):
        return None
    return PatchSpec(patch_size=vp.patch_size, merge_size=vp.merge_size,
                     temporal_patch_size=vp.temporal_patch_size, mean=tuple(mean),
                     std=tuple(std), rescale_factor=vp.rescale_factor)


def grid_rows(grid_thw: torch.Tensor | tuple[int, int, int]) -> torch.Tensor:
    """``grid_thw`` as (n, 3) long rows of positive (t, h, w); ValueError otherwise."""
    grid = torch.as_tensor(grid_thw, dtype=torch.long)
    if grid.dim() == 1:
        grid = grid.unsqueeze(0)
    if grid.dim() != 2 or grid.shape[1] != 3 or bool((grid <= 0).any()):
        raise ValueError(f"grid_thw must be (t, h, w) rows of positive ints, got {grid.tolist()}")
    return grid


def patch_grid(pixel_values: torch.Tensor,
               grid_thw: torch.Tensor | tuple[int, int, int]) -> torch.Tensor:
    """:func:`grid_rows` of ``grid_thw``, checked against the patch rows ``pixel_values``
    (n_patches, row) it describes; ValueError naming both when they do not match."""
    grid = grid_rows(grid_thw)
    patches = int(grid.prod(dim=1).sum())
    if pixel_values.dim() != 2 or pixel_values.shape[0] != patches:
        raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not match the grid "
                         f"{grid.tolist()} ({patches} patch rows)")
    return grid
