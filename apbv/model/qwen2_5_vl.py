"""Stock HF Qwen2.5-VL driven by apbv: loading, the attention hook, and the pieces we call.

No modeling file is forked. The decoder's attention is routed through transformers' attention
registry: the text model runs with ``attn_implementation="apbv"``, whose function hands the
post-RoPE q/k/v of each layer to the :class:`apbv.context.AttentionContext` installed around the
forward (prefill: APB-V attention; decode: exact attention over the distributed cache). The
vision tower keeps PyTorch SDPA.

Every difference between transformers versions is handled in this module and nowhere else.
Tested: transformers 5.24 (pinned in pyproject.toml). Known drift:
- 5.x returns the vision tower's merged embeddings as ``pooler_output`` of a model output;
  4.x returned the tensor itself (:meth:`QwenVL.vision_tower`).
- 5.24's ``get_rope_index`` resumes text after a video at a different position than the rule
  the checkpoints were trained with; we never let the model compute positions
  (see :mod:`apbv.positions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface, AutoProcessor, Qwen2_5_VLForConditionalGeneration
from transformers.utils import logging as hf_logging

from apbv.context import current

ATTN_IMPLEMENTATION = "apbv"


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
    """Make ``attn_implementation="apbv"`` known to transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, _hf_attention)


@dataclass
class QwenVL:
    """A loaded Qwen2.5-VL checkpoint and the pieces apbv drives."""

    model: Qwen2_5_VLForConditionalGeneration
    processor: Any

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
        return self.text_config.max_position_embeddings

    def process_frames(self, frames: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        out = self.processor.video_processor(
            videos=[frames], do_resize=False, do_sample_frames=False,
            cap_pixels_per_frame=True, return_tensors="pt",
        )
        return out["pixel_values_videos"], tuple(out["video_grid_thw"][0].tolist())

    def video_span(self, ids: torch.Tensor) -> tuple[int, int]:
        from apbv.positions import video_token_runs

        runs = video_token_runs(ids, self.video_token_id)
        if len(runs) != 1:
            raise ValueError(f"expected one video in the prompt, found video tokens at {runs}")
        return runs[0][0], runs[0][1] - runs[0][0]

    def vision_tower(
        self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]
    ) -> torch.Tensor:
        """Vision tower on patch rows (n_patches, C*2*14*14) -> merged embeddings (n_tokens, hidden)."""
        visual = self.model.model.visual
        out = visual(pixel_values.to(self.device, visual.dtype),
                     grid_thw=torch.tensor([grid_thw], device=self.device))
        return out if isinstance(out, torch.Tensor) else out.pooler_output

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (1, T) -> embeddings (1, T, hidden)."""
        return self.model.model.language_model.embed_tokens(ids.to(self.device))

    def decoder(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The decoder layers and final norm on (1, T, hidden) with positions (3, 1, T).

        Attention goes through the installed :class:`apbv.context.AttentionContext`.
        """
        out = self.model.model.language_model(
            inputs_embeds=inputs_embeds,
            position_ids=position_ids.to(self.device),
            use_cache=False,
        )
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)


def load(path: str | Path, *, device: torch.device, dtype: torch.dtype) -> QwenVL:
    """Load a Qwen2.5-VL checkpoint directory (no downloads) for apbv's prefill and decode."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"model directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    register_attention()
    hf_logging.disable_progress_bar()  # one bar per rank is noise in a multi-rank log
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        path,
        local_files_only=True,
        dtype=dtype,
        attn_implementation={"text_config": ATTN_IMPLEMENTATION, "vision_config": "sdpa"},
    )
    if model.config.model_type != "qwen2_5_vl":
        raise ValueError(f"{str(path)!r} is a {model.config.model_type!r} checkpoint; "
                         "supported: qwen2_5_vl")
    model.to(device).eval()
    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    return QwenVL(model=model, processor=processor)
