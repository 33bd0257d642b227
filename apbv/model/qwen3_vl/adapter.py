"""The Qwen3-VL adapter (``model_type`` qwen3_vl, dense): stock HF Qwen3-VL driven by apbv.

It implements :class:`apbv.model.adapter.VideoModel` (the contract is written there). Frames
are chosen and sized by the stock video processor's rules
(:mod:`apbv.model.qwen3_vl.prompt`: ``linspace`` sampling, the processor's pixel budget for the
whole clip) and become patch rows of 2-frame temporal patches of 16x16 pixels through the stock
video processor. The prompt holds one run of ``<|video_pad|>`` tokens per temporal patch, each
after its ``<t seconds>`` text and inside its own ``<|vision_start|>`` ... ``<|vision_end|>``;
positions are interleaved M-RoPE by the stock ``get_rope_index`` (each temporal patch its own
one-frame grid).

The vision tower (stock, SDPA) attends inside one temporal patch and places its learned and
rotary positions by the patch grid alone, so a rank runs it on its whole temporal patches and
the concatenation of the ranks' rows equals the tower on the whole video. Each tower row is a
video token's main embedding followed by its DeepStack features, one per
``deepstack_visual_indexes`` entry (:attr:`Qwen3VL.extra_levels`), so the engine moves them
to the rank that owns the token with the main embedding; :meth:`Qwen3VL.decoder` adds level i
to the hidden states after decoder layer i at the shard's video tokens, as the stock text model
does.

Live streams hold the same prompt chunk by chunk (:meth:`Qwen3VL.stream_prompt`,
:class:`apbv.model.qwen3_vl.prompt.Qwen3VLStreamPrompt`): each temporal patch's ``<t seconds>``
is the mean capture time of its two frames since the stream's first frame, as the stock
processor times a patch of a file's frames; a chunk's tower rows carry their DeepStack levels,
added at the chunk's video tokens as in the one-shot prefill. Decoded-frame requests
(``DecodedVideo(frames, fps, image_patch_size=16)``) time frame i at i / fps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import Qwen3VLForConditionalGeneration

from apbv.model.common.hf_decoder import QwenVideoLM, load_stock
from apbv.model.common.tower import CPU_CHUNK_ROWS, patch_grid, tower_chunks
from apbv.model.qwen3_vl.prompt import FAMILY, Qwen3VLRules, Qwen3VLStreamPrompt
from apbv.video import Sampling, VideoMeta, VideoSpec
from apbv.video.patches import PIPELINE_CHUNK_ROWS, patches_per_chunk
from apbv.video.prune import pruned_grid

if TYPE_CHECKING:
    from apbv.config import VisionConfig
    from apbv.model.adapter import VideoFeatures

MODEL_TYPE = "qwen3_vl"
TEXT_MODEL_TYPES = ("qwen3_vl_text",)
"""Decoders this adapter runs (dense); the MoE variant (``qwen3_vl_moe``) is refused."""


@dataclass
class Qwen3VL(QwenVideoLM):
    """A loaded Qwen3-VL checkpoint and the pieces apbv drives (see the module docstring)."""

    model: Qwen3VLForConditionalGeneration

    @property
    def family(self) -> str:
        return FAMILY

    @property
    def extra_levels(self) -> int:
        """DeepStack feature levels after the main embedding in each tower row."""
        return len(self.vision_config.deepstack_visual_indexes)

    @property
    def tokens_per_second(self) -> float:
        """0: time enters the prompt as timestamp text, not as positions."""
        return 0.0

    @property
    def rules(self) -> Qwen3VLRules:
        """The weight-free frame choice and prompt (:mod:`apbv.model.qwen3_vl.prompt`)."""
        return Qwen3VLRules(self.processor)

    def set_vision(self, vision: VisionConfig) -> None:
        """Patch rows per tower call from ``vision.chunk_rows`` (unset:
        :data:`apbv.model.common.tower.CPU_CHUNK_ROWS` on CPU, the whole share elsewhere); the other
        settings are Qwen2.5-VL's tower's: the stock Qwen3-VL tower runs as it is."""
        self.chunk_rows = vision.chunk_rows if vision.chunk_rows is not None \
            else CPU_CHUNK_ROWS if self.device.type == "cpu" else 0

    def process_frames(self, frames: torch.Tensor, *, levels: bool = False,
                       ) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Already-resized frames (F, 3, H, W) uint8, H and W multiples of patch x merge (32)
        -> the stock video processor's patch rows (n_patches, 3*2*16*16) and (t, h, w) grid
        (an odd frame count padded with the last frame). ``levels`` is not supported."""
        vp = self.processor.video_processor
        self.check_frames(frames)
        if levels:
            raise ValueError(f"{FAMILY} frames are processed by its processor: no pixel levels")
        processed = vp(videos=[frames], do_resize=False, do_sample_frames=False,
                       return_tensors="pt",
                       cap_pixels_per_frame=bool(getattr(vp, "cap_pixels_per_frame", False)))
        t, h, w = (int(x) for x in processed["video_grid_thw"][0].tolist())
        return processed["pixel_values_videos"], (t, h, w)

    def tower_rows(self, frames: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        return self.process_frames(frames)

    def frames_per_chunk(self, height: int, width: int) -> int:
        """Frames per chunk of :meth:`encode_frames`: whole temporal patches, about
        :attr:`chunk_rows` patch rows (else :data:`PIPELINE_CHUNK_ROWS`)."""
        vp = self.processor.video_processor
        rows = (height // vp.patch_size) * (width // vp.patch_size)
        return vp.temporal_patch_size * patches_per_chunk(
            rows, self.chunk_rows or PIPELINE_CHUNK_ROWS)

    def vision_tower(self, pixel_values: torch.Tensor,
                     grid_thw: torch.Tensor | tuple[int, int, int]) -> torch.Tensor:
        """Patch rows (n_patches, 3*2*16*16) of whole temporal patches with their (t, h, w)
        grid -> rows (n_tokens, hidden * (1 + :attr:`extra_levels`)) in video-token order:
        the merged embedding, then the DeepStack features of each level (the stock tower's
        ``pooler_output`` and ``deepstack_features``), :attr:`chunk_rows` rows per call."""
        grid = patch_grid(pixel_values, grid_thw)
        visual = self.model.model.visual
        outs = []
        for first, end, call_grid in tower_chunks(grid, self.chunk_rows):
            rows = pixel_values[first:end].to(self.device, visual.dtype)
            out = visual(rows, grid_thw=call_grid.to(self.device))
            outs.append(torch.cat([out.pooler_output, *out.deepstack_features], dim=-1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def plan_sampling(self, spec: VideoSpec, meta: VideoMeta) -> Sampling:
        return self.rules.plan_sampling(spec, meta)

    def video_grid(self, sampling: Sampling) -> tuple[int, int, int]:
        return self.rules.video_grid(sampling)

    def prompt(self, question: str, video_grid: tuple[int, int, int],
               system: str | None = None, *, sampling: Sampling | None = None,
               kept: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rules.prompt(question, video_grid, system, sampling=sampling, kept=kept)

    def stream_prompt(self, grid_hw: tuple[int, int]) -> Qwen3VLStreamPrompt:
        """A live stream's pieces of :meth:`prompt`'s prompt for frames of the ``grid_hw``
        (h, w) patch grid: per temporal patch its ``<t seconds>`` (the unit's time in the
        stream) and markers around its video tokens, interleaved M-RoPE positions."""
        merge = self.spatial_merge_size
        return Qwen3VLStreamPrompt(self.processor, (grid_hw[0] // merge, grid_hw[1] // merge))

    def positions(self, ids: torch.Tensor, video_grid: tuple[int, int, int],
                  second_per_grid_t: float, kept: Sequence[int] | None = None) -> torch.Tensor:
        """(3, 1, T) int64 interleaved M-RoPE positions of the prompt ``ids`` (T,) holding one
        video of ``video_grid`` (t, h, w) (or its ``kept`` temporal patches), by the stock
        ``get_rope_index`` (time is in the timestamp text: ``second_per_grid_t`` and which
        patches were kept do not move them; each patch is its own one-frame grid)."""
        ids = ids.reshape(1, -1).cpu()
        types = (ids == self.video_token_id).int() * 2  # the processor's mm_token_type_ids
        positions, _ = self.model.model.get_rope_index(
            ids, types, video_grid_thw=torch.tensor([list(pruned_grid(video_grid, kept))]))
        return positions

    def decoder(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                video_features: VideoFeatures | None = None) -> torch.Tensor:
        """The decoder layers and final norm on (1, T, hidden) with positions (3, 1, T); with
        ``video_features`` the DeepStack levels added after layers 0, 1, ... at the video
        tokens (the stock text model's ``visual_pos_masks`` and ``deepstack_visual_embeds``).
        Attention goes through the installed :class:`apbv.context.AttentionContext`."""
        extra: dict[str, Any] = {}
        if video_features is not None:
            extra = {"visual_pos_masks": self.on_device(video_features.mask),
                     "deepstack_visual_embeds": video_features.levels}
        return self.run_decoder(inputs_embeds, position_ids, **extra)


def load(path: str | Path, *, device: torch.device, dtype: torch.dtype,
         vision: VisionConfig | None = None) -> Qwen3VL:
    """Load a Qwen3-VL checkpoint directory (no downloads). Checked first: a wrong or
    incomplete directory, or a decoder other than :data:`TEXT_MODEL_TYPES`, is a ValueError
    before any weight is read."""
    return load_stock(Qwen3VL, Qwen3VLForConditionalGeneration, path, model_type=MODEL_TYPE,
                      family=FAMILY, device=device, dtype=dtype, vision=vision,
                      text_types=TEXT_MODEL_TYPES)
