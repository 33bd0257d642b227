"""Stock HF Qwen2.5-VL driven by apbv: loading, the attention hook, and the pieces we call.

No modeling file is forked. The decoder's attention is routed through transformers' attention
registry: the text model runs with ``attn_implementation="apbv"``, whose function hands the
post-RoPE q/k/v of each layer to the :class:`apbv.context.AttentionContext` installed around the
forward (prefill: APB-V attention; decode: exact attention over the distributed cache). The
vision tower's attention is registered too (:data:`VISION_ATTN_IMPLEMENTATION`,
:mod:`apbv.model.vision_attention`): equal-size windows batched into one call per size, or a
varlen kernel on CUDA; ``vision.attention=per_window`` keeps the stock SDPA path. The patch
embedding runs as one matrix product (:mod:`apbv.model.patch_embed`; ``vision.patch_embed=conv``
keeps the stock Conv3d), the q/k rotary runs on q and k together (``vision.rotary``), on CUDA
the RMSNorms run as one kernel and the MLPs are padded to an aligned width
(``vision.norm``, ``vision.mlp_pad``; :mod:`apbv.model.vision_blocks`), and the tower runs a
few temporal patches per call on CPU (``vision.chunk_rows``; every vision block attends inside
one temporal patch, so the chunks are independent). :func:`set_tower` applies these.

Every difference between transformers versions is handled in this module (and, for writing the
tiny checkpoint, in :mod:`apbv.model.tiny` through :func:`rope_config`) and nowhere else.
Tested: transformers 4.57.x, 5.17.x and 5.24.x (``bash scripts/compat.sh VERSION``). Drift:

- vision tower: 5.x returns a model output with the merged embeddings as ``pooler_output``,
  4.x the tensor itself (:meth:`QwenVL.vision_tower`);
- RoPE settings: 5.x keeps them in ``rope_parameters`` (with ``rope_theta``), 4.x in
  ``rope_scaling`` (``mrope_section``) next to a ``rope_theta`` attribute (:func:`rope_config`,
  :func:`rope_settings`); 5.x reads 4.x's keys, and :func:`load_config` makes 4.x read 5.x's;
- tokenizer: 5.x loads ``Qwen2Tokenizer`` (tokenizers-backed), 4.x ``Qwen2TokenizerFast``
  (:data:`TOKENIZER_CLASS`);
- video processor: 5.x takes ``cap_pixels_per_frame`` (and warns without it), 4.57 does not
  know it (:func:`video_processor_kwargs`). The per-frame pixel cap of qwen-vl-utils is applied
  by :mod:`apbv.video` when it resizes the frames, so processing already-resized frames
  (:meth:`QwenVL.process_frames`) gives the same patches on every version;
- ``from_pretrained``'s dtype argument: ``dtype`` (``torch_dtype`` before 4.56);
- attention registry: ``AttentionInterface.register``; an implementation the mask registry does
  not know gets no mask built, on 4.57 as on 5.x;
- vision attention: 5.x hands the packed sequence of a block with its ``cu_seqlens`` (one call
  per block) to every implementation whose name contains "flash", hence the name of
  :data:`VISION_ATTN_IMPLEMENTATION`; 4.57 does so only for ``flash_attention_2`` and calls
  ours once per window, which stays exact but is not grouped. The implementation is set on
  the loaded vision config (:func:`set_vision_attention`), not passed to ``from_pretrained``,
  whose checks would treat the name as a flash-attn kernel to fetch;
- vision rotary: 4.57 and 5.x call the module-level ``apply_rotary_pos_emb_vision`` of the
  modeling module at every block, which :func:`set_vision_rotary` replaces (a version without
  it keeps its own rotary);
- 5.24's ``get_rope_index`` resumes text after a video at a different position than the rule
  the checkpoints were trained with; we never let the model compute positions
  (see :mod:`apbv.positions`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import types
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from packaging.version import Version
from transformers import (
    AttentionInterface,
    AutoProcessor,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
from transformers.utils import logging as hf_logging

from apbv.config import PATCH_EMBED, VISION_ATTENTION, VISION_NORM, VISION_ROTARY
from apbv.context import current
from apbv.model.checkpoint import validate_checkpoint
from apbv.model.patch_embed import linear_patch_embed
from apbv.model.vision_attention import fused_rotary, hf_vision_attention
from apbv.model.vision_blocks import CUDA_MLP_PAD, fused_rms_norm, pad_mlp
from apbv.positions import video_token_runs
from apbv.validate import one_of
from apbv.video.patches import (
    PIPELINE_CHUNK_ROWS,
    PatchSpec,
    levels_to_rows,
    patch_rows,
    patches_per_chunk,
)

if TYPE_CHECKING:
    from apbv.config import VisionConfig

ATTN_IMPLEMENTATION = "apbv"
VISION_ATTN_IMPLEMENTATION = "apbv_vision_flash"
"""The grouped vision attention's registry name ("flash": see the drift notes above)."""
CPU_CHUNK_ROWS = 8192
"""``vision.chunk_rows`` left unset: patch rows per vision-tower call on CPU (whole temporal
patches; the activations of a call stay in cache, which made the tower 8-20% faster than one
call for the video in benchmarks/bench_vision.py); on other devices the video goes in one
call, as fewer, larger kernels are what a GPU needs."""
SUPPORTED_TRANSFORMERS = ">=4.57,<5.25"
TRANSFORMERS_VERSION = Version(transformers.__version__)
V5 = TRANSFORMERS_VERSION.major >= 5
TOKENIZER_CLASS = "Qwen2Tokenizer" if V5 else "Qwen2TokenizerFast"
"""Class name of the tokenizer ``AutoProcessor`` loads for a Qwen2.5-VL checkpoint."""


def rope_config(mrope_section: list[int], rope_theta: float) -> dict[str, Any]:
    """The text-config keys that set M-RoPE (``mrope_section``: temporal, height, width
    frequency sections summing to head_dim / 2) in this transformers version."""
    if V5:
        return {"rope_parameters": {"rope_type": "default", "mrope_section": list(mrope_section),
                                    "rope_theta": rope_theta}}
    return {"rope_scaling": {"rope_type": "default", "mrope_section": list(mrope_section)},
            "rope_theta": rope_theta}


def rope_settings(text_config: Any) -> dict[str, Any]:
    """``{"rope_type", "mrope_section", "rope_theta"}`` of a loaded text config, any version
    (the legacy ``type`` key some configs carry is dropped)."""
    if V5:
        params = dict(text_config.rope_parameters or {})
    else:
        params = dict(text_config.rope_scaling or {})
        params["rope_theta"] = text_config.rope_theta
    params.setdefault("rope_type", params.get("type", "default"))
    return {key: params.get(key) for key in ("rope_type", "mrope_section", "rope_theta")}


def video_processor_kwargs(video_processor: Any) -> dict[str, Any]:
    """Arguments every video-processor call gets: the per-frame pixel cap of qwen-vl-utils
    where the processor has the switch (5.x; without it 5.x warns and does not cap)."""
    known = getattr(getattr(video_processor, "valid_kwargs", None), "__annotations__", {})
    if "cap_pixels_per_frame" in known:
        return {"cap_pixels_per_frame": True}
    return {}


def _hf_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q/k/v (B, heads, T, D) -> out (B, T, Hq, D).

    HF builds no mask for an implementation it does not know, so ``attention_mask`` is None;
    the masks are structural (the plan) and never derived from positions.
    """
    assert attention_mask is None, "apbv attention takes no explicit mask"
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = current().attend(
        module.layer_idx, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale
    )
    return out, None


def register_attention() -> None:
    """Make the ``apbv`` decoder and vision attentions known to transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, _hf_attention)
    AttentionInterface.register(VISION_ATTN_IMPLEMENTATION, hf_vision_attention)


def set_vision_attention(model: Qwen2_5_VLForConditionalGeneration, name: str) -> None:
    """Select the vision tower's attention: ``grouped`` (one call per window size, or one
    varlen call on CUDA) or ``per_window`` (the stock SDPA path, one call per window)."""
    one_of("vision.attention", name, VISION_ATTENTION)
    register_attention()
    config = model.model.visual.config
    config._attn_implementation = VISION_ATTN_IMPLEMENTATION if name == "grouped" else "sdpa"


def set_vision_rotary(name: str) -> None:
    """Select how the vision tower applies its q/k rotary: ``fused`` (q and k in one set of
    passes, bit-equal to transformers', :func:`apbv.model.vision_attention.fused_rotary`) or
    ``stock``. transformers looks the function up in its modeling module at every call, so
    the choice holds for the whole process; both give bit-equal values, so models of one
    process never compute different numbers because of it, only at a different speed."""
    one_of("vision.rotary", name, VISION_ROTARY)
    current_fn = getattr(modeling_qwen2_5_vl, "apply_rotary_pos_emb_vision", None)
    if current_fn is None:  # a version without the module-level function (drift notes)
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


def _rows_in_worker(process: Any, chunks: Iterable[torch.Tensor],
                    ) -> Generator[tuple[torch.Tensor, tuple[int, int, int]], None, None]:
    """``process(chunk)`` for each chunk, run ahead by one in a worker thread: the next
    chunk's rows are made while the caller uses the current ones (at most one waits). An
    error in the worker is raised here; closing the generator stops and joins the worker."""
    ready: queue.Queue[Any] = queue.Queue(maxsize=1)
    stop, end = threading.Event(), object()

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
            for chunk in chunks:
                if not hand_over(process(chunk)):
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
            yield item
    finally:
        stop.set()
        worker.join()


def set_patch_embed(model: Qwen2_5_VLForConditionalGeneration, name: str) -> None:
    """Select the vision tower's patch embedding: ``linear`` (one matrix product,
    :mod:`apbv.model.patch_embed`; it also takes pixel levels) or ``conv`` (the stock Conv3d).
    Only this instance changes."""
    one_of("vision.patch_embed", name, PATCH_EMBED)
    _swap_forward(model.model.visual.patch_embed, linear_patch_embed if name == "linear" else None)


def set_vision_norm(model: Qwen2_5_VLForConditionalGeneration, name: str) -> None:
    """Select the vision tower's RMSNorms (its blocks' and the merger's): ``fused``
    (:func:`apbv.model.vision_blocks.fused_rms_norm`: one kernel on CUDA) or ``stock``. Only
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
    """Set up the vision tower of ``model`` (on ``device``) as ``vision`` says: its attention
    (:func:`set_vision_attention`), patch embedding (:func:`set_patch_embed`), q/k rotary
    (:func:`set_vision_rotary`, for the whole process), RMSNorms (:func:`set_vision_norm`) and
    MLP width (:func:`apbv.model.vision_blocks.pad_mlp`; ``mlp_pad`` unset: padded on CUDA
    only)."""
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


def _grid_rows(grid_thw: torch.Tensor | tuple[int, int, int]) -> torch.Tensor:
    grid = torch.as_tensor(grid_thw, dtype=torch.long)
    if grid.dim() == 1:
        grid = grid.unsqueeze(0)
    if grid.dim() != 2 or grid.shape[1] != 3 or bool((grid <= 0).any()):
        raise ValueError(f"grid_thw must be (t, h, w) rows of positive ints, got {grid.tolist()}")
    return grid


@dataclass
class QwenVL:
    """A loaded Qwen2.5-VL checkpoint and the pieces apbv drives."""

    model: Qwen2_5_VLForConditionalGeneration
    processor: Any
    preprocess: str = "fused"
    """Frames to patch rows: levels or fused (apbv.video.patches) or processor (the HF
    processor); :meth:`set_vision` sets it."""
    preprocess_workers: int = 1
    chunk_rows: int = 0
    """Patch rows per vision-tower call (whole temporal patches; 0: the video in one call)."""

    @property
    def embeds_levels(self) -> bool:
        """Whether the patch embedding takes pixel levels itself: the linear one
        (:func:`set_patch_embed`) does, the stock Conv3d does not."""
        return "forward" in self.model.model.visual.patch_embed.__dict__

    @property
    def text_config(self) -> Any:
        return self.model.config.text_config

    @property
    def vision_config(self) -> Any:
        return self.model.config.vision_config

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def video_token_id(self) -> int:
        return self.model.config.video_token_id

    @property
    def spatial_merge_size(self) -> int:
        return self.vision_config.spatial_merge_size

    @property
    def tokens_per_second(self) -> float:
        return self.vision_config.tokens_per_second

    @property
    def eos_token_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.processor.tokenizer.eos_token_id
        return set(eos) if isinstance(eos, (list, tuple)) else {eos}

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype

    @property
    def max_positions(self) -> int:
        """The model's context: prompt plus generated tokens at most."""
        return self.text_config.max_position_embeddings

    @property
    def rope_inv_freq(self) -> torch.Tensor:
        """(head_dim / 2,) fp32 inverse frequencies of the decoder's M-RoPE."""
        return self.model.model.language_model.rotary_emb.inv_freq.float()

    def process_frames(self, frames: torch.Tensor, *, levels: bool = False,
                       ) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Already-resized frames (F, 3, H, W) uint8 -> patch rows (n_patches, C*2*14*14) and
        the (t, h, w) patch grid; H and W must be multiples of patch size * merge size (28).

        No resizing and no frame sampling happen here: :mod:`apbv.video` samples and resizes
        (qwen-vl-utils' rules, its per-frame pixel cap included). An odd frame count is padded
        with the last frame, as the processor does. The rows equal the video processor's bit
        for bit (:mod:`apbv.video.patches`, ``preprocess_workers`` threads), or are the
        processor's own (``preprocess="processor"``, or settings other than rescale and
        normalise). ``levels``: int8 pixel levels instead, where this module makes the rows
        (:meth:`vision_tower` takes both; :func:`apbv.video.patches.levels_to_rows` makes the
        float rows of them).
        """
        vp = self.processor.video_processor
        factor = vp.patch_size * vp.merge_size
        if not isinstance(frames, torch.Tensor) or frames.dtype != torch.uint8 \
                or frames.dim() != 4 or frames.shape[1] != 3 or frames.shape[0] < 1:
            got = (f"{frames.dtype} {tuple(frames.shape)}" if isinstance(frames, torch.Tensor)
                   else type(frames).__name__)
            raise ValueError(f"frames must be a uint8 tensor (F, 3, H, W) with F >= 1, got {got}")
        height, width = frames.shape[-2:]
        if height % factor or width % factor:
            raise ValueError(f"frame size {height}x{width} is not a multiple of {factor}: resize "
                             "the frames first (apbv.video does)")
        spec = patch_spec(vp) if self.preprocess != "processor" else None
        if spec is not None:  # the processor's arithmetic in fewer passes (apbv.video.patches)
            return patch_rows(frames, spec, workers=self.preprocess_workers, levels=levels)
        processed = vp(videos=[frames], do_resize=False, do_sample_frames=False,
                       return_tensors="pt", **video_processor_kwargs(vp))
        t, h, w = (int(x) for x in processed["video_grid_thw"][0].tolist())
        return processed["pixel_values_videos"], (t, h, w)

    def tower_rows(self, frames: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """:meth:`process_frames` as the vision tower takes them best: pixel levels with
        ``preprocess="levels"`` and the linear patch embedding (a quarter of the float rows'
        bytes; the normalisation is folded into the embedding), else the float rows."""
        return self.process_frames(frames, levels=self.preprocess == "levels"
                                   and self.embeds_levels)

    def video_span(self, ids: torch.Tensor) -> tuple[int, int]:
        """(start, number of video tokens) of the one video in a 1-D prompt ``ids`` (T,)."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
            got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"prompt ids must be a 1-D tensor (T,), got {got}")
        runs = video_token_runs(ids, self.video_token_id)
        if len(runs) != 1:
            found = "no video tokens" if not runs else \
                f"{len(runs)} separate runs of video tokens at {runs}"
            raise ValueError(f"expected one video in the prompt (one run of video token "
                             f"{self.video_token_id}), found {found}")
        start, end = runs[0]
        return start, end - start

    def set_vision(self, vision: VisionConfig) -> None:
        """Set up the vision tower and the patch rows as ``vision`` says: the tower's modules
        (:func:`set_tower`), patch rows per tower call
        (``chunk_rows``; unset: :data:`CPU_CHUNK_ROWS` on CPU, the whole video elsewhere) and
        how frames become patch rows (``preprocess``, ``preprocess_workers``)."""
        set_tower(self.model, vision, self.device)
        # How pixel levels become rows: the processor's settings (None: it does more).
        self.model.model.visual.patch_embed.levels_spec = patch_spec(self.processor.video_processor)
        self.chunk_rows = vision.chunk_rows if vision.chunk_rows is not None \
            else CPU_CHUNK_ROWS if self.device.type == "cpu" else 0
        self.preprocess = vision.preprocess
        self.preprocess_workers = vision.preprocess_workers

    def vision_tower(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | tuple[int, int, int]
    ) -> torch.Tensor:
        """Vision tower on patch rows (n_patches, C*2*14*14): float rows or int8 pixel levels
        (:meth:`tower_rows`), with their (t, h, w) grid (a tuple, or a tensor of such rows) ->
        merged embeddings (n_tokens, hidden).

        Every vision block attends inside one temporal patch (a window of it, or all of it), so
        the tower runs on chunks of whole temporal patches (:attr:`chunk_rows`,
        :func:`tower_chunks`) and the embeddings are concatenated in order. Levels go to the
        device as they are; the stock Conv3d gets them as the processor's float rows."""
        grid = _grid_rows(grid_thw)
        patches = int(grid.prod(dim=1).sum())
        if pixel_values.dim() != 2 or pixel_values.shape[0] != patches:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not match the grid "
                             f"{grid.tolist()} ({patches} patch rows)")
        visual = self.model.model.visual
        levels = pixel_values.dtype == torch.int8
        spec = visual.patch_embed.__dict__.get("levels_spec")
        if levels and spec is None:
            raise ValueError("int8 pixel levels need a processor that rescales and normalises")
        outs = []
        for first, end, call_grid in tower_chunks(grid, self.chunk_rows):
            rows = pixel_values[first:end].to(self.device)
            if levels and not self.embeds_levels:
                rows = levels_to_rows(rows, spec)
            if rows.dtype != torch.int8:
                rows = rows.to(visual.dtype)
            out = visual(rows, grid_thw=call_grid.to(self.device))
            outs.append(out if isinstance(out, torch.Tensor) else out.pooler_output)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def frames_per_chunk(self, height: int, width: int) -> int:
        """Frames per chunk of :meth:`encode_frames` for frames of ``height`` x ``width``
        pixels: whole temporal patches, about :attr:`chunk_rows` patch rows (else
        :data:`PIPELINE_CHUNK_ROWS`)."""
        vp = self.processor.video_processor
        rows = (height // vp.patch_size) * (width // vp.patch_size)
        return vp.temporal_patch_size * patches_per_chunk(
            rows, self.chunk_rows or PIPELINE_CHUNK_ROWS)

    def encode_frames(self, chunks: Iterable[torch.Tensor], *,
                      overlap: bool | None = None) -> torch.Tensor:
        """Patch rows and vision tower chunk by chunk: frame chunks (uint8 (k, 3, H, W), whole
        temporal patches each, in order; e.g. :class:`apbv.video.load.FrameChunks`, which
        decode as they are reached) -> merged embeddings (n_tokens, hidden), equal to
        ``vision_tower(*tower_rows(all frames))``, with the rows of a chunk or two held
        instead of all.

        ``overlap`` (default: on any device but the CPU): a worker thread takes the next chunk
        (decoding it) and makes its rows while this thread runs the tower on the current one;
        on a CPU rank the two would only share its core. ``chunks`` is closed at the end (if it
        has ``close``); an error on either side stops both and is raised here."""
        if overlap is None:
            overlap = self.device.type != "cpu"
        rows = (_rows_in_worker(self.tower_rows, chunks) if overlap
                else (self.tower_rows(chunk) for chunk in chunks))
        outs = []
        try:
            with contextlib.closing(rows):  # stops and joins the worker first
                outs = [self.vision_tower(*item) for item in rows]
        finally:
            if (close := getattr(chunks, "close", None)) is not None:
                close()
        if not outs:
            raise ValueError("encode_frames got no frames")
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the model's device: itself when it is there already (a decode step's
        inputs), without asking for a copy."""
        return t if t.device == self.device else t.to(self.device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (1, T) -> embeddings (1, T, hidden)."""
        return self.model.model.language_model.embed_tokens(self.on_device(ids))

    def decoder(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The decoder layers and final norm on (1, T, hidden) with positions (3, 1, T).

        Attention goes through the installed :class:`apbv.context.AttentionContext`.
        """
        out = self.model.model.language_model(
            inputs_embeds=inputs_embeds,
            position_ids=self.on_device(position_ids),
            use_cache=False,
        )
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)


def dtype_kwargs(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """``from_pretrained``'s dtype argument under its name in this version."""
    return {"dtype" if TRANSFORMERS_VERSION >= Version("4.56") else "torch_dtype": dtype}


def load_config(path: str | Path) -> Qwen2_5_VLConfig:
    """The checkpoint's config; on 4.x a config saved by 5.x (``rope_parameters``, no
    ``rope_scaling``) gets its M-RoPE settings moved to the keys 4.x reads."""
    config = Qwen2_5_VLConfig.from_pretrained(path, local_files_only=True)
    text = config.text_config
    params = getattr(text, "rope_parameters", None)
    if not V5 and text.rope_scaling is None and isinstance(params, dict):
        text.rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        text.rope_theta = params.get("rope_theta", text.rope_theta)
        del text.rope_parameters
    return config


def load(path: str | Path, *, device: torch.device, dtype: torch.dtype,
         vision: VisionConfig | None = None) -> QwenVL:
    """Load a Qwen2.5-VL checkpoint directory (no downloads) for apbv's prefill and decode,
    its vision tower set up by ``vision`` (:meth:`QwenVL.set_vision`; None: the defaults).

    The directory is checked first (:func:`apbv.model.checkpoint.validate_checkpoint`): a
    wrong or incomplete checkpoint is a ValueError before any weight is read.
    """
    if vision is None:
        from apbv.config import VisionConfig

        vision = VisionConfig()
    path = validate_checkpoint(path)
    if TRANSFORMERS_VERSION < Version("4.57"):
        raise ValueError(f"transformers {transformers.__version__} is too old: apbv needs "
                         f"transformers{SUPPORTED_TRANSFORMERS}")
    register_attention()
    hf_logging.disable_progress_bar()  # one bar per rank is noise in a multi-rank log
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        path,
        config=load_config(path),
        local_files_only=True,
        attn_implementation={"text_config": ATTN_IMPLEMENTATION, "vision_config": "sdpa"},
        **dtype_kwargs(dtype),
    )
    model.to(device).eval()
    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    qwen = QwenVL(model=model, processor=processor)
    qwen.set_vision(vision)
    return qwen
