"""The Qwen2.5-VL adapter (``model_type`` ``qwen2_5_vl``): stock HF Qwen2.5-VL driven by apbv.

It implements :class:`apbv.model.adapter.VideoModel` (the contract is written there): frames
resized by :mod:`apbv.video` (qwen-vl-utils' rules) become patch rows of 2-frame temporal
patches, the vision tower (:mod:`apbv.model.common.tower`) runs on a rank's whole temporal patches,
a
2x2 merge gives ``(h / 2) * (w / 2)`` tokens per temporal patch, the prompt holds one run of
``<|video_pad|>`` tokens, and positions are 3-D M-RoPE (:mod:`apbv.positions`). The decoder's
attention goes through :mod:`apbv.model.common.hook`; transformers version drift is handled in
:mod:`apbv.model.common.hf_compat`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from apbv.model.common.hf_compat import (
    load_config,
    tower_output,
    video_processor_kwargs,
)
from apbv.model.common.hf_decoder import QwenVideoLM, load_stock, tower_over
from apbv.model.common.tower import (
    CPU_CHUNK_ROWS,
    patch_grid,
    patch_spec,
    rows_in_worker,
    set_tower,
    tower_chunks,
)
from apbv.model.qwen2_5_vl.prompt import QwenRules, QwenStreamPrompt
from apbv.plan import Range
from apbv.positions import mrope_positions, video_token_runs
from apbv.video import Sampling, VideoMeta, VideoSpec
from apbv.video.patches import (
    PIPELINE_CHUNK_ROWS,
    levels_to_rows,
    patch_rows,
    patches_per_chunk,
)
from apbv.video.prune import pruned_grid

if TYPE_CHECKING:
    from apbv.config import VisionConfig
    from apbv.model.adapter import VideoFeatures

MODEL_TYPE = "qwen2_5_vl"
FAMILY = "Qwen2.5-VL"


@dataclass
class QwenVL(QwenVideoLM):
    """A loaded Qwen2.5-VL checkpoint and the pieces apbv drives."""

    model: Qwen2_5_VLForConditionalGeneration
    preprocess: str = "fused"
    """Frames to patch rows: levels or fused (apbv.video.patches) or processor (the HF
    processor); :meth:`set_vision` sets it."""
    preprocess_workers: int = 1

    extra_levels = 0
    """Tower rows are the merged embeddings alone."""

    @property
    def embeds_levels(self) -> bool:
        """Whether the patch embedding takes pixel levels itself: the linear one
        (:func:`apbv.model.common.tower.set_patch_embed`) does, the stock Conv3d does not."""
        return "forward" in self.model.model.visual.patch_embed.__dict__

    @property
    def family(self) -> str:
        """The family's name, e.g. for ``/v1/models``."""
        return FAMILY

    @property
    def tokens_per_second(self) -> float:
        return self.vision_config.tokens_per_second

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
        self.check_frames(frames)
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

    def video_runs(self, ids: torch.Tensor) -> list[Range]:
        """The one run [start, end) of video tokens in a 1-D prompt ``ids`` (T,)."""
        start, length = self.video_span(ids)
        return [(start, start + length)]

    def plan_sampling(self, spec: VideoSpec, meta: VideoMeta) -> Sampling:
        """qwen-vl-utils' frame choice and resize (:func:`apbv.video.plan_sampling`)."""
        return QwenRules(self.processor).plan_sampling(spec, meta)

    def video_grid(self, sampling: Sampling) -> tuple[int, int, int]:
        """The processor's ``video_grid_thw`` of the sampled, resized frames."""
        return QwenRules(self.processor).video_grid(sampling)

    def prompt(self, question: str, video_grid: tuple[int, int, int],
               system: str | None = None, *, sampling: Sampling | None = None,
               kept: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Context ids (N,) with one run of ``(t * h * w) / merge**2`` video tokens for the
        patch grid ``video_grid`` (t, h, w) (t: the ``kept`` temporal patches when given),
        and query ids (Q,) (:func:`apbv.sequence.build_prompt`; ``sampling`` is not needed)."""
        return QwenRules(self.processor).prompt(question, pruned_grid(video_grid, kept), system)

    def positions(self, ids: torch.Tensor, video_grid: tuple[int, int, int],
                  second_per_grid_t: float, kept: Sequence[int] | None = None) -> torch.Tensor:
        """(3, 1, T) int64 M-RoPE positions of the whole prompt ``ids`` (T,) holding one video
        of ``video_grid`` (t, h, w) patches (or its ``kept`` temporal patches, each at its own
        time), ``second_per_grid_t`` seconds per temporal patch
        (:func:`apbv.positions.mrope_positions`: the rule the checkpoints were trained with)."""
        return mrope_positions(ids, [video_grid], [second_per_grid_t],
                               video_token_id=self.video_token_id,
                               spatial_merge_size=self.spatial_merge_size,
                               tokens_per_second=self.tokens_per_second, kept=[kept])

    def stream_prompt(self, grid_hw: tuple[int, int]) -> QwenStreamPrompt:
        """A live stream's pieces of :meth:`prompt`'s prompt for frames of the ``grid_hw``
        (h, w) patch grid: one run of video tokens, M-RoPE positions from their times."""
        merge = self.spatial_merge_size
        return QwenStreamPrompt(self.processor, (grid_hw[0] // merge, grid_hw[1] // merge),
                                self.tokens_per_second)

    def set_vision(self, vision: VisionConfig) -> None:
        """Set up the vision tower and the patch rows as ``vision`` says: the tower's modules
        (:func:`apbv.model.common.tower.set_tower`), patch rows per tower call (``chunk_rows``;
        unset:
        :data:`apbv.model.common.tower.CPU_CHUNK_ROWS` on CPU, the whole video elsewhere) and how
        frames become patch rows (``preprocess``, ``preprocess_workers``)."""
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
        :func:`apbv.model.common.tower.tower_chunks`) and the embeddings are concatenated in order.
        Levels go to the device as they are; the stock Conv3d gets them as the processor's
        float rows."""
        grid = patch_grid(pixel_values, grid_thw)
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
            outs.append(tower_output(out))
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
        rows = (rows_in_worker(self.tower_rows, chunks, self.device) if overlap
                else (self.tower_rows(chunk) for chunk in chunks))
        return tower_over(self.vision_tower, rows, chunks)

    def decoder(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                video_features: VideoFeatures | None = None) -> torch.Tensor:
        """The decoder layers and final norm on (1, T, hidden) with positions (3, 1, T)
        (``video_features``: none in this family).

        Attention goes through the installed :class:`apbv.context.AttentionContext`.
        """
        assert video_features is None, "Qwen2.5-VL has no extra vision features"
        return self.run_decoder(inputs_embeds, position_ids)


def load(path: str | Path, *, device: torch.device, dtype: torch.dtype,
         vision: VisionConfig | None = None) -> QwenVL:
    """Load a Qwen2.5-VL checkpoint directory (no downloads) for apbv's prefill and decode,
    its vision tower set up by ``vision`` (:meth:`QwenVL.set_vision`; None: the defaults).

    The directory is checked first (:func:`apbv.model.checkpoint.validate_checkpoint`): a
    wrong or incomplete checkpoint is a ValueError before any weight is read.
    """
    return load_stock(QwenVL, Qwen2_5_VLForConditionalGeneration, path, model_type=MODEL_TYPE,
                      family=FAMILY, device=device, dtype=dtype, vision=vision,
                      config=load_config)
