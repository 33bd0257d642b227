"""What every family's adapter reads the same way from a transformers vision-language model:
its configs, end-of-answer tokens, device and dtype, context length, RoPE frequencies, token
embedding and LM head (:class:`HFVisionLM`, a base of each adapter). The model object is
``model.model.language_model`` (the decoder) plus ``model.lm_head``, as transformers 5 lays out
every family apbv runs; :func:`load_stock` loads one the way every adapter does."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from apbv.model.checkpoint import read_config, validate_checkpoint
from apbv.positions import video_token_runs

if TYPE_CHECKING:
    from apbv.config import VisionConfig
    from apbv.plan import Range



class _Adapter(Protocol):
    """What :func:`load_stock` makes (``adapter(model=..., processor=...)``) and sets up."""

    def set_vision(self, vision: VisionConfig) -> None: ...


A = TypeVar("A", bound=_Adapter)


@dataclass
class HFVisionLM:
    """The shared half of an adapter over ``self.model`` (a transformers
    ``...ForConditionalGeneration``) and ``self.processor`` (its stock processor), with the
    vision settings every family has (:meth:`set_vision` sets them)."""

    model: Any
    processor: Any
    chunk_rows: int = 0
    """Patch rows per vision-tower call (whole temporal units; 0: the share in one call)."""
    preprocess: str = "processor"
    """How frames become patch rows (the stock processor's float rows unless the family has
    its own ways)."""
    streams: bool = True
    """Live streams (:mod:`apbv.engine.stream`) run this family (:meth:`stream_prompt`)."""

    @property
    def embeds_levels(self) -> bool:
        """Whether the patch embedding takes pixel levels itself (the stock one does not)."""
        return False

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

    def run_decoder(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                    **extra: Any) -> torch.Tensor:
        """The stock decoder layers and final norm without a cache: hidden (1, T, hidden) of
        ``inputs_embeds`` (1, T, hidden) at ``position_ids`` (the family's layout), with the
        family's ``extra`` keyword inputs."""
        out = self.model.model.language_model(inputs_embeds=inputs_embeds,
                                              position_ids=self.on_device(position_ids),
                                              use_cache=False, **extra)
        return out.last_hidden_state

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (1, T) -> embeddings (1, T, hidden)."""
        return self.model.model.language_model.embed_tokens(self.on_device(ids))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)

    @property
    def video_token_id(self) -> int:
        """The family's video placeholder token."""
        raise NotImplementedError

    def video_runs(self, ids: torch.Tensor) -> list[Range]:
        """[start, end) of each run of :attr:`video_token_id` in the prompt ``ids`` (T,) (a
        frame's, or a temporal patch's); ValueError when there is none."""
        runs = video_token_runs(ids, self.video_token_id)
        if not runs:
            raise ValueError(f"expected video tokens ({self.video_token_id}) in the prompt")
        return runs

    def video_span(self, ids: torch.Tensor) -> tuple[int, int]:
        """(first video token, number of video tokens) of a 1-D prompt ``ids`` (T,)
        (:meth:`video_runs`)."""
        runs = self.video_runs(ids)
        return runs[0][0], sum(end - start for start, end in runs)

    def tower_rows(self, frames: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """The family's (:meth:`apbv.model.adapter.VideoModel.tower_rows`)."""
        raise NotImplementedError

    def vision_tower(self, pixel_values: torch.Tensor,
                     grid_thw: torch.Tensor | tuple[int, int, int]) -> torch.Tensor:
        """The family's (:meth:`apbv.model.adapter.VideoModel.vision_tower`)."""
        raise NotImplementedError

    def encode_frames(self, chunks: Iterable[torch.Tensor], *,
                      overlap: bool | None = None) -> torch.Tensor:
        """Frame chunks (uint8 (k, 3, H, W), whole temporal units, in order) -> the rows of
        ``vision_tower(*tower_rows(all frames))``, chunk by chunk (``overlap`` is ignored: one
        thread)."""
        return tower_over(self.vision_tower, (self.tower_rows(chunk) for chunk in chunks),
                          chunks)


def tower_over(tower: Callable[[torch.Tensor, tuple[int, int, int]], torch.Tensor],
               rows: Generator[tuple[torch.Tensor, tuple[int, int, int]], None, None],
               chunks: Iterable[torch.Tensor]) -> torch.Tensor:
    """``tower`` on each (patch rows, grid) of ``rows`` (made from ``chunks``, in order) ->
    the outputs joined (n_tokens, ...). ``rows`` is closed (a worker is stopped and joined),
    then ``chunks`` (if it has ``close``), on an error too; ValueError when there were none."""
    outs: list[torch.Tensor] = []
    try:
        with contextlib.closing(rows):  # a worker's is stopped and joined first
            outs = [tower(*item) for item in rows]
    finally:
        if (close := getattr(chunks, "close", None)) is not None:
            close()
    if not outs:
        raise ValueError("encode_frames got no frames")
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class QwenVideoLM(HFVisionLM):
    """What the two Qwen families (2.5-VL, 3-VL) read the same way from their configs and
    video processor: the video placeholder, the spatial merge, frames per temporal patch and
    a stream frame's side multiple."""

    @property
    def video_token_id(self) -> int:
        return self.model.config.video_token_id

    @property
    def spatial_merge_size(self) -> int:
        return self.vision_config.spatial_merge_size

    @property
    def temporal_patch_size(self) -> int:
        """Frames per temporal patch of the vision tower (2)."""
        return self.processor.video_processor.temporal_patch_size

    @property
    def frame_multiple(self) -> int:
        """A stream's frame sides are multiples of this (pixels): patch x merge (28 for
        Qwen2.5-VL, 32 for Qwen3-VL)."""
        vp = self.processor.video_processor
        return vp.patch_size * vp.merge_size

    def check_frames(self, frames: Any) -> None:
        """ValueError unless ``frames`` is a uint8 tensor (F, 3, H, W), F >= 1, with H and W
        multiples of :attr:`frame_multiple` (already resized)."""
        if not isinstance(frames, torch.Tensor) or frames.dtype != torch.uint8 \
                or frames.dim() != 4 or frames.shape[1] != 3 or frames.shape[0] < 1:
            got = (f"{frames.dtype} {tuple(frames.shape)}" if isinstance(frames, torch.Tensor)
                   else type(frames).__name__)
            raise ValueError(f"frames must be a uint8 tensor (F, 3, H, W) with F >= 1, got {got}")
        factor = self.frame_multiple
        height, width = frames.shape[-2:]
        if height % factor or width % factor:
            raise ValueError(f"frame size {height}x{width} is not a multiple of {factor}: resize "
                             "the frames first (apbv.video does)")


def load_stock(adapter: Callable[..., A], model_class: Any, path: str | Path, *, model_type: str,
               family: str, device: torch.device, dtype: torch.dtype,
               vision: VisionConfig | None, text_types: tuple[str, ...] | None = None,
               config: Callable[[Path], Any] | None = None) -> A:
    """``adapter(model=..., processor=...)`` over ``model_class.from_pretrained`` of the
    checkpoint directory ``path`` (no downloads; ``config`` reads the config object to load it
    with from the checked directory, None: its own) and the stock processor beside it, the
    vision tower set up by ``vision`` (None: the defaults). Checked first, before any weight
    is read: the directory (:func:`apbv.model.checkpoint.validate_checkpoint`, ``model_type``
    of ``family``) and, given ``text_types``, the decoder's ``text_config.model_type``:
    ValueError naming it."""
    from transformers import AutoProcessor
    from transformers.utils import logging as hf_logging

    from apbv.config import VisionConfig
    from apbv.model.common.hf_compat import check_version, dtype_kwargs
    from apbv.model.common.hook import ATTN_IMPLEMENTATION, register_attention

    path = validate_checkpoint(path, {model_type: family})
    if text_types is not None:
        text_type = (read_config(path).get("text_config") or {}).get("model_type")
        if text_type not in text_types:
            raise ValueError(f"{str(path)!r} has a {text_type!r} decoder; {family} runs "
                             f"{', '.join(text_types)}")
    check_version()
    register_attention()
    hf_logging.disable_progress_bar()  # one bar per rank is noise in a multi-rank log
    extra = {} if config is None else {"config": config(path)}
    model = model_class.from_pretrained(
        path, local_files_only=True,
        attn_implementation={"text_config": ATTN_IMPLEMENTATION, "vision_config": "sdpa"},
        **extra, **dtype_kwargs(dtype))
    model.to(device).eval()
    loaded = adapter(model=model, processor=AutoProcessor.from_pretrained(
        path, local_files_only=True))
    loaded.set_vision(vision or VisionConfig())
    return loaded
