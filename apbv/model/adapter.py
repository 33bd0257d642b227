"""The model adapter contract: what a model family provides to the engine, and nothing else.

An adapter wraps one stock transformers vision-language model (no modeling file is forked) and
is chosen by the checkpoint's ``config.json`` ``model_type`` (:mod:`apbv.model.families`). The
engine holds a :class:`VideoModel` and never names a family module. An adapter provides:

1. **Load and refuse.** Its module's ``load(path, *, device, dtype, vision)`` loads a local
   checkpoint (no downloads) and returns the adapter. What it cannot run is refused with a
   ValueError before any weight is read: :func:`apbv.model.families.load_adapter` checks the
   directory (:func:`apbv.model.checkpoint.validate_checkpoint`) and the family first, and an
   adapter refuses variants of its family it cannot run (e.g. MoE) from the config alone.
2. **Frame sampling and processing.** :meth:`VideoModel.plan_sampling` is the family's rule
   for which frames of a file, at what size, in temporal units of
   :attr:`apbv.video.Sampling.temporal_patch_size` frames (ranks split whole units); frames
   arrive decoded and resized by :mod:`apbv.video` (uint8 (F, 3, H, W));
   :meth:`VideoModel.video_grid` is the (t, h, w) patch grid of a sampling;
   :meth:`VideoModel.process_frames` / :meth:`VideoModel.tower_rows` turn them
   into the rows the vision tower takes and their (t, h, w) patch grid, equal to the family's
   stock processor on the same frames; :meth:`VideoModel.frames_per_chunk` says how many
   frames make whole temporal units for chunked runs.
3. **Prompt ids with the video runs.** :attr:`VideoModel.processor` (tokenizer and chat
   template), :meth:`VideoModel.prompt` (context and query ids for a question over a video of
   a given patch grid and, for a family whose prompt holds its frames' times, its
   :class:`apbv.video.Sampling`), :attr:`VideoModel.video_token_id` and
   :meth:`VideoModel.video_runs`: the runs of video placeholder tokens in a prompt, in order
   (one for Qwen2.5-VL, one per frame for InternVL3, one per temporal patch for Qwen3-VL
   after its timestamp text). With ``kept`` (temporal pruning, :mod:`apbv.video.prune`) the
   prompt holds only those temporal patches, each with the text that goes with it (Qwen3-VL's
   ``<t seconds>``, InternVL3's ``FrameN:``, as in the whole video's prompt).
4. **The vision tower over a rank's frame share.** :meth:`VideoModel.vision_tower` (rows and
   grid) and :meth:`VideoModel.encode_frames` (frame chunks) -> embeddings (n_tokens, hidden)
   in video-token order, for whole temporal units only, so ranks encode disjoint frame shares
   and the concatenation equals the tower on the whole video; ``spatial_merge_size`` gives the
   tokens per temporal unit, ``(h / m) * (w / m)``; :meth:`VideoModel.set_vision` applies
   :class:`apbv.config.VisionConfig`. A family with per-token vision features used inside
   the decoder (Qwen3-VL's DeepStack) appends them to each row: rows are (n_tokens,
   hidden * (1 + :attr:`VideoModel.extra_levels`)), the main embedding first, so whatever
   moves or keeps a row (routing, the vision cache) carries them along.
5. **Where each video embedding goes.** The k-th video embedding replaces the embedding
   (:meth:`VideoModel.embed`) of the k-th ``video_token_id`` token of the prompt, counted over
   every run, on the rank that owns that token (:class:`apbv.ownership.VideoSpan`,
   :mod:`apbv.engine.routing`); its extra levels go with it into
   :meth:`VideoModel.decoder` as :class:`VideoFeatures` over the shard's video tokens.
6. **Positions for any token range.** :meth:`VideoModel.positions` gives the (3, 1, T) RoPE
   positions of the whole prompt once; the engine shards them with the tokens. A 1-D RoPE
   family gives three equal rows. With ``kept``, the kept patches' tokens keep the positions
   the family's rule gives them in that prompt (Qwen2.5-VL: their own times).
   :attr:`VideoModel.rope_inv_freq` lets cached keys be moved
   to other positions (stream rebasing), :attr:`VideoModel.max_positions` is the context.
7. **The attention hook.** :meth:`VideoModel.decoder` runs the decoder layers with every
   layer's attention routed to the installed :class:`apbv.context.AttentionContext`
   (:mod:`apbv.model.common.hook`), adding the :class:`VideoFeatures` when given;
   :meth:`VideoModel.logits` is the LM head.
8. **Cost-model shapes.** :attr:`VideoModel.text_config` and :attr:`VideoModel.vision_config`
   (sizes the memory preflight reads); the cost model reads the same shapes from
   ``config.json`` (:func:`apbv.cost.model_dims`).

9. **Live streams.** :meth:`VideoModel.stream_prompt` gives the family's
   :class:`apbv.model.stream_prompt.StreamPrompt` for frames of a patch grid: the header ids
   before the first frame, each appended chunk's ids (its video tokens and the family's text
   around them, e.g. InternVL3's ``FrameN: <img>...</img>`` numbered on from the frames fed
   before it, Qwen3-VL's ``<t seconds>`` from its units' capture times) with their positions,
   and the ids after the video; the query ids are
   :meth:`VideoModel.prompt`'s. :attr:`VideoModel.temporal_patch_size` frames make a unit (a
   stream chunk and a decoded-frames request hold whole units); a stream's frame sides are
   multiples of :attr:`VideoModel.frame_multiple`. The engine's stream code
   (:mod:`apbv.engine.stream`) builds no prompt and no position itself. A family without
   streams says so (:attr:`VideoModel.streams` False) and the engine refuses to open one.

Implementations: :class:`apbv.model.qwen2_5_vl.adapter.QwenVL` (Qwen2.5-VL),
:class:`apbv.model.internvl.adapter.InternVL` (InternVL3),
:class:`apbv.model.qwen3_vl.adapter.Qwen3VL`
(Qwen3-VL, dense).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from apbv.config import VisionConfig
    from apbv.model.stream_prompt import StreamPrompt
    from apbv.plan import Range
    from apbv.video import Sampling, VideoMeta, VideoSpec


@dataclass(frozen=True)
class VideoFeatures:
    """A shard's extra per-token vision features (:attr:`VideoModel.extra_levels` > 0) as
    :meth:`VideoModel.decoder` takes them."""

    mask: torch.Tensor
    """(1, T) bool: the shard's video tokens."""
    levels: list[torch.Tensor]
    """Per level, (m, hidden) with m = ``mask.sum()``: added to the hidden states after decoder
    layer i (level i) at the video tokens, in order."""


class VideoModel(Protocol):
    """A loaded checkpoint as the engine drives it (the contract above)."""

    processor: Any
    """The family's stock processor: ``.tokenizer`` (with the chat template) and
    ``.video_processor``."""
    chunk_rows: int
    """Patch rows per vision-tower call (0: the rank's share in one call)."""
    preprocess: str
    """How frames become patch rows (``vision.preprocess``: levels, fused or processor); the
    memory preflight counts its rows' bytes."""
    streams: bool
    """Whether live streams run this family (the engine refuses to open one otherwise)."""

    @property
    def embeds_levels(self) -> bool:
        """Whether the patch embedding takes uint8 pixel levels (one byte a value) itself."""

    @property
    def extra_levels(self) -> int:
        """Per-token vision feature levels after the main embedding in each tower row (0:
        none; Qwen3-VL: its DeepStack levels)."""

    @property
    def family(self) -> str:
        """The family's name, e.g. ``Qwen2.5-VL``."""

    @property
    def text_config(self) -> Any: ...

    @property
    def vision_config(self) -> Any: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def video_token_id(self) -> int: ...

    @property
    def spatial_merge_size(self) -> int: ...

    @property
    def temporal_patch_size(self) -> int:
        """Frames per temporal unit of the vision tower (Qwen2.5-VL 2, InternVL3 1)."""

    @property
    def frame_multiple(self) -> int:
        """A live stream's frame sides must be multiples of this (pixels; checked at open)."""

    @property
    def tokens_per_second(self) -> float: ...

    @property
    def eos_token_ids(self) -> set[int]: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def max_positions(self) -> int: ...

    @property
    def rope_inv_freq(self) -> torch.Tensor: ...

    def set_vision(self, vision: VisionConfig) -> None: ...

    def process_frames(self, frames: torch.Tensor, *, levels: bool = False,
                       ) -> tuple[torch.Tensor, tuple[int, int, int]]: ...

    def tower_rows(self, frames: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]: ...

    def frames_per_chunk(self, height: int, width: int) -> int: ...

    def vision_tower(self, pixel_values: torch.Tensor,
                     grid_thw: torch.Tensor | tuple[int, int, int]) -> torch.Tensor: ...

    def encode_frames(self, chunks: Iterable[torch.Tensor], *,
                      overlap: bool | None = None) -> torch.Tensor: ...

    def plan_sampling(self, spec: VideoSpec, meta: VideoMeta) -> Sampling: ...

    def video_grid(self, sampling: Sampling) -> tuple[int, int, int]: ...

    def prompt(self, question: str, video_grid: tuple[int, int, int],
               system: str | None = None, *, sampling: Sampling | None = None,
               kept: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def video_runs(self, ids: torch.Tensor) -> list[Range]: ...

    def positions(self, ids: torch.Tensor, video_grid: tuple[int, int, int],
                  second_per_grid_t: float, kept: Sequence[int] | None = None,
                  ) -> torch.Tensor: ...

    def stream_prompt(self, grid_hw: tuple[int, int]) -> StreamPrompt:
        """The live-stream pieces of the prompt for frames of the (h, w) patch grid
        ``grid_hw`` (:meth:`video_grid`'s, before the merge)."""

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...

    def decoder(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                video_features: VideoFeatures | None = None) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...
