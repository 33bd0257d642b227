"""HF's own single-process Qwen2.5-VL (SDPA) on the same inputs and positions as apbv: the
reference the model-level tests compare with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from apbv.config import RuntimeConfig
from apbv.model.qwen2_5_vl.adapter import QwenVL, load
from apbv.positions import mrope_positions
from apbv.sequence import prompt_ids, split_prompt
from apbv.video import RankFrames, load_all_frames


@dataclass
class HFReference:
    model: QwenVL
    """apbv's adapter of the same checkpoint (processor, tokenizer, sizes)."""
    hf: Any
    """The stock model, attention by SDPA."""
    frames: RankFrames
    pixels: torch.Tensor
    grid: torch.Tensor
    """(1, 3) video_grid_thw."""
    context_text: str
    query_text: str
    ids: torch.Tensor
    """(T,) the prompt's ids, built as the engine builds them."""
    positions: torch.Tensor
    """(3, 1, T) M-RoPE positions of the prompt (the trained rule)."""

    @torch.inference_mode()
    def logits(self, extra: list[int]) -> torch.Tensor:
        """(T + len(extra), vocab) fp32 logits of HF's forward over the prompt and ``extra``
        tokens, whose positions continue at max + 1 on all three axes."""
        seq = torch.cat([self.ids, torch.tensor(extra, dtype=torch.long)])
        more = torch.arange(len(extra)) + int(self.positions.max()) + 1
        pos = torch.cat([self.positions, more.view(1, 1, -1).expand(3, 1, -1)], dim=2)
        return self.hf(input_ids=seq.unsqueeze(0), pixel_values_videos=self.pixels,
                       video_grid_thw=self.grid, position_ids=pos).logits[0].float()


def hf_reference(cfg: RuntimeConfig, video: str, question: str) -> HFReference:
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = load(cfg.model.path, device=torch.device("cpu"), dtype=torch.float32)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        cfg.model.path, local_files_only=True, attn_implementation="sdpa").eval()
    frames = load_all_frames(cfg.video.spec(video))
    pixels, (t, h, w) = model.process_frames(frames.frames)
    context_text, query_text = split_prompt(model.processor, question)
    ids = torch.cat(prompt_ids(model.processor.tokenizer, context_text, query_text, question,
                               t * h * w // 4))
    positions = mrope_positions(ids, [(t, h, w)], [frames.sampling.second_per_grid_t],
                                video_token_id=model.video_token_id, spatial_merge_size=2,
                                tokens_per_second=model.tokens_per_second)
    return HFReference(model, hf, frames, pixels, torch.tensor([[t, h, w]]), context_text,
                       query_text, ids, positions)
