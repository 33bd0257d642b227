"""What every family's adapter reads the same way from a transformers vision-language model:
its configs, end-of-answer tokens, device and dtype, context length, RoPE frequencies, token
embedding and LM head (:class:`HFVisionLM`, a base of each adapter). The model object is
``model.model.language_model`` (the decoder) plus ``model.lm_head``, as transformers 5 lays out
every family apbv runs."""

from __future__ import annotations

from typing import Any

import torch


class HFVisionLM:
    """The shared half of an adapter over ``self.model`` (a transformers
    ``...ForConditionalGeneration``) and ``self.processor`` (its stock processor)."""

    model: Any
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
        """(head_dim / 2,) fp32 inverse frequencies of the decoder's RoPE (M-RoPE's too)."""
        return self.model.model.language_model.rotary_emb.inv_freq.float()

    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the model's device: itself when it is there already (a decode step's
        inputs), without asking for a copy."""
        return t if t.device == self.device else t.to(self.device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (1, T) -> embeddings (1, T, hidden)."""
        return self.model.model.language_model.embed_tokens(self.on_device(ids))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)
