"""Counted work of one request, and the sizes it depends on.

Pairs: :func:`rank_pairs` counts the query-key pairs a rank scores in one APB-V layer under a
plan (the sum of :func:`anchor_pairs`, :func:`block_pairs` of its blocks and
:func:`query_pairs`), :func:`full_pairs` those of single-process causal attention. FLOPs of
softmax attention = 4 * D * Hq * pairs (QK^T and PV, a multiply-add each); causal squares count
n(n+1)/2 pairs. Sizes: :class:`ModelDims` from a checkpoint (:func:`checkpoint_dims`), a
config.json dict (:func:`model_dims`) or a preset of :data:`MODEL_PRESETS`; the video geometry
by the runtime's sampling rules (:func:`video_grid`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apbv.cost.config_json import decoder_fields, required
from apbv.cost.internvl import (
    INTERNVL_VIDEO_END,
    INTERNVL_VIDEO_START,
    internvl_fields,
    internvl_video_start,
    released_internvl3,
)
from apbv.cost.qwen3_vl import (
    QWEN3_VL_VIDEO_START,
    qwen3_vl_fields,
    qwen3_vl_video_start,
    released_qwen3_vl_8b,
)
from apbv.plan import QUERY_RANK, Plan
from apbv.video import VideoMeta, VideoSpec, plan_sampling


def _causal(n: int) -> int:
    return n * (n + 1) // 2


def anchor_pairs(plan: Plan) -> int:
    """Pairs of the anchor rows (causal over the anchor), which every rank computes."""
    return _causal(plan.anchor_len)


def block_pairs(plan: Plan, block: int) -> int:
    """Pairs of virtual block ``block``'s rows: the anchor, the passed selections of the earlier
    blocks and the block itself, causally."""
    n = plan.block_len(block)
    passed = sum(plan.selected_len(u) for u in range(block))
    return n * (plan.anchor_len + passed) + _causal(n)


def query_pairs(plan: Plan, rank: int) -> int:
    """Pairs of the query rows' partial attention on ``rank``: over the context keys it owns
    (its anchor share and its blocks), and causally over the query on the query rank only."""
    a0, a1 = plan.anchor_share(rank)
    blocks_len = sum(plan.block_len(b) for b in plan.rank_blocks(rank))
    q = plan.query_len
    return q * (a1 - a0 + blocks_len) + (_causal(q) if rank == QUERY_RANK else 0)


def rank_pairs(plan: Plan, rank: int) -> int:
    """Query-key pairs rank ``rank`` scores in one APB-V layer (use ``plan.exact()`` for exact)."""
    return (anchor_pairs(plan) + sum(block_pairs(plan, b) for b in plan.rank_blocks(rank))
            + query_pairs(plan, rank))


def full_pairs(plan: Plan) -> int:
    """Pairs of ordinary causal attention over the whole prompt in one process."""
    return _causal(plan.total_len)


def attention_flops(pairs: int, num_heads: int, head_dim: int) -> float:
    return 4.0 * head_dim * num_heads * pairs


# ---------------------------------------------------------------------------------------------
# Model dimensions.


@dataclass(frozen=True)
class ModelDims:
    """The sizes of a Qwen2.5-VL checkpoint that the cost model needs."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    vision_depth: int
    vision_hidden: int
    vision_intermediate: int
    vision_heads: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    window_size: int = 112
    """Vision attention window edge in pixels; window_size // merge // patch merged tokens."""
    fullatt_blocks: int = 4
    """Vision blocks attending over a whole temporal patch; the others attend in windows."""
    tied_embeddings: bool = False
    """The LM head shares the input embedding's weights (``tie_word_embeddings``)."""
    video_start: int | None = None
    """Context tokens before the first video token under the checkpoint's chat template, for a
    user turn holding a video and a question (:func:`template_video_start`); None where no
    template was read (a prediction with video then needs ``video_start`` passed)."""
    vision_gated: bool = True
    """The vision MLP is gated (Qwen2.5-VL's SwiGLU: gate, up, down) or not (InternViT's
    fc1, GELU, fc2)."""
    projector_hidden: int | None = None
    """Width of the projector's middle layer: None, Qwen2.5-VL's merger (vision hidden * merge
    ** 2); InternVL3's pixel-shuffle MLP goes to the text hidden size at once."""
    tiled_frames: bool = False
    """Every frame is resized to one square tile of ``window_size`` pixels, its one attention
    window (InternVL3: 448); False: qwen-vl-utils' resize rule (:func:`video_grid`)."""
    unit_text_tokens: int = 0
    """Text tokens around each temporal unit's video tokens in the prompt (InternVL3's
    ``FrameN: <img>`` ... ``</img>`` and new line; about 7, more for long frame numbers)."""
    deepstack_levels: int = 0
    """Extra per-token vision features carried with each video embedding (Qwen3-VL's
    DeepStack: 3 in the 8B); each level is one more merger's work and parameters and one
    more row of ``hidden`` values in the embeddings held and moved."""

    @property
    def embedding_width(self) -> int:
        """Values per video token the vision tower emits and routing moves: the embedding and
        its DeepStack levels."""
        return self.hidden * (1 + self.deepstack_levels)

    @property
    def frame_side(self) -> int | None:
        """The side of the square tile every frame is resized to (None: not tiled)."""
        return self.window_size if self.tiled_frames else None

    @property
    def window_tokens(self) -> int:
        """Merged tokens along each edge of a vision attention window."""
        return max(1, self.window_size // self.spatial_merge_size // self.patch_size)

    def text_linears(self) -> list[tuple[int, int]]:
        """(in, out) of the matmuls of one decoder layer: q, k, v, o, gate, up, down."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]

    def parameters(self) -> int:
        """Parameters of the checkpoint: embeddings, LM head, decoder layers (matmuls, q/k/v
        biases, two norms), the final norm, and the vision tower (patch embedding, blocks with
        their biases and norms, merger)."""
        q, kv, vh = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.vision_hidden
        layer = _weights(self.text_linears()) + q + 2 * kv + 2 * self.hidden
        merge = self.spatial_merge_size**2
        vision = (self.in_channels * self.temporal_patch_size * self.patch_size**2 * vh
                  + self.vision_depth * (_weights(self.vision_linears())
                                         + 7 * vh + 2 * self.vision_intermediate)
                  + vh + _weights(self.projector_linears()) + vh * merge + self.hidden
                  + self.deepstack_levels * (_weights(self.projector_linears())
                                             + 2 * vh * merge + self.hidden))
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return embeddings + self.layers * layer + self.hidden + vision

    def vision_linears(self) -> list[tuple[int, int]]:
        """(in, out) of the matmuls of one vision block, per patch: qkv, proj, then gate, up,
        down (gated MLP) or fc1, fc2."""
        h, i = self.vision_hidden, self.vision_intermediate
        mlp = [(h, i), (h, i), (i, h)] if self.vision_gated else [(h, i), (i, h)]
        return [(h, 3 * h), (h, h), *mlp]

    def projector_linears(self) -> list[tuple[int, int]]:
        """(in, out) of the projector's matmuls per merged token (vision to text width)."""
        wide = self.vision_hidden * self.spatial_merge_size**2
        mid = self.projector_hidden or wide
        return [(wide, mid), (mid, self.hidden)]


def _text_section(config: Mapping[str, Any]) -> Mapping[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def model_dims(config: Mapping[str, Any], *, video_start: int | None = None) -> ModelDims:
    """ModelDims from a Qwen2.5-VL, InternVL3 (``model_type`` internvl:
    :func:`apbv.cost.internvl.internvl_fields`) or Qwen3-VL (``model_type`` qwen3_vl:
    :func:`apbv.cost.qwen3_vl.qwen3_vl_fields`) config.json dict (``video_start``: see
    :class:`ModelDims`).

    Both forms are read: transformers v5's nested one (``text_config`` and ``vision_config``)
    and the released checkpoints' flat one (text fields at the top, ``vision_config`` nested).
    ``num_key_value_heads`` and ``head_dim`` default as in transformers (to the attention heads
    and hidden / heads).
    """
    if config.get("model_type") == "internvl":
        return ModelDims(**internvl_fields(config, video_start=video_start))
    if config.get("model_type") == "qwen3_vl":
        return ModelDims(**qwen3_vl_fields(config, video_start=video_start))
    text = _text_section(config)
    vision = config.get("vision_config")
    if not isinstance(vision, Mapping):
        raise ValueError("config.json has no vision_config: not a Qwen2.5-VL checkpoint")
    where = "text_config" if text is not config else "the top level"
    decoder = decoder_fields(config, text, where)
    hidden = decoder["hidden"]
    fullatt = required(vision, "vision_config", "fullatt_block_indexes")
    out_hidden = vision.get("out_hidden_size", hidden)
    if out_hidden != hidden:
        raise ValueError(f"vision_config.out_hidden_size ({out_hidden}) differs from the text "
                         f"hidden_size ({hidden})")
    return ModelDims(
        **decoder,
        vision_depth=required(vision, "vision_config", "depth"),
        vision_hidden=required(vision, "vision_config", "hidden_size"),
        vision_intermediate=required(vision, "vision_config", "intermediate_size"),
        vision_heads=required(vision, "vision_config", "num_heads"),
        patch_size=required(vision, "vision_config", "patch_size", "spatial_patch_size"),
        temporal_patch_size=required(vision, "vision_config", "temporal_patch_size"),
        spatial_merge_size=required(vision, "vision_config", "spatial_merge_size"),
        in_channels=vision.get("in_channels", vision.get("in_chans", 3)),
        window_size=required(vision, "vision_config", "window_size"),
        fullatt_blocks=len(fullatt),
        video_start=video_start,
    )


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """A checkpoint directory's config.json (no weights are read)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{str(path)!r} not found")
    return json.loads(path.read_text())


def _released_config(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int,
                     vocab: int, tied: bool) -> dict[str, Any]:
    """The fields of a released Qwen2.5-VL config.json (flat form) that ModelDims reads."""
    return {
        "tie_word_embeddings": tied, "num_hidden_layers": layers, "hidden_size": hidden,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "intermediate_size": intermediate, "vocab_size": vocab,
        "vision_config": {
            "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
            "in_chans": 3, "out_hidden_size": hidden, "patch_size": 14, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
        },
    }


RELEASED_VIDEO_START = 15
"""What :func:`template_video_start` gives for the chat template of the released
Qwen2.5-VL-Instruct checkpoints (``chat_template.json``; the tiny checkpoint ships the same):
the default system prompt, the user header and ``<|vision_start|>``. A test derives it."""

MODEL_PRESETS: dict[str, ModelDims] = {
    "qwen2.5-vl-3b": model_dims(_released_config(36, 2048, 16, 2, 11008, 151936, True),
                                video_start=RELEASED_VIDEO_START),
    "qwen2.5-vl-7b": model_dims(_released_config(28, 3584, 28, 4, 18944, 152064, False),
                                video_start=RELEASED_VIDEO_START),
    "internvl3-2b": model_dims(released_internvl3(28, 1536, 12, 2, 8960, False),
                               video_start=INTERNVL_VIDEO_START),
    "internvl3-8b": model_dims(released_internvl3(28, 3584, 28, 4, 18944, False),
                               video_start=INTERNVL_VIDEO_START),
    "qwen3-vl-8b": model_dims(released_qwen3_vl_8b(), video_start=QWEN3_VL_VIDEO_START),
}
"""Qwen2.5-VL-3B/7B-Instruct, InternVL3-2B/8B-hf and Qwen3-VL-8B-Instruct as released
(config.json and chat template on the Hugging Face hub;
:func:`apbv.cost.internvl.released_internvl3`, :func:`apbv.cost.qwen3_vl.released_qwen3_vl_8b`)."""


def template_video_start(model_dir: str | Path) -> int:
    """Context tokens before the first video token when the runtime builds a prompt with the
    checkpoint's own processor: its chat template rendered for one user turn holding a video
    and a question, tokenized as the engine does it (:func:`apbv.sequence.build_prompt`).
    Reads the processor files only, no weights."""
    from transformers import AutoProcessor

    from apbv.sequence import VIDEO_PAD, build_prompt

    try:
        processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load the processor (chat template and tokenizer) of "
                         f"{str(model_dir)!r}: {exc}") from None
    if read_config(model_dir).get("model_type") == "internvl":
        return internvl_video_start(processor)
    if read_config(model_dir).get("model_type") == "qwen3_vl":
        return qwen3_vl_video_start(processor)
    ids, _ = build_prompt(processor, "What happens in the video?", 1)
    return ids.tolist().index(processor.tokenizer.convert_tokens_to_ids(VIDEO_PAD))


RELEASED_VIDEO_STARTS = {"qwen2_5_vl": RELEASED_VIDEO_START, "internvl": INTERNVL_VIDEO_START,
                         "qwen3_vl": QWEN3_VL_VIDEO_START}
"""Context tokens before the video in each family's released chat template, by model_type."""


def config_dims(model_dir: str | Path) -> ModelDims:
    """ModelDims of a checkpoint from its config.json alone, the context before the video
    taken as its family's released template's (:data:`RELEASED_VIDEO_STARTS`): no processor
    is loaded (seconds of tokenizer files), for relative costs such as the eval's ETA weights,
    which a few tokens do not move. :func:`checkpoint_dims` reads the checkpoint's own."""
    config = read_config(model_dir)
    return model_dims(config, video_start=RELEASED_VIDEO_STARTS.get(
        str(config.get("model_type")), RELEASED_VIDEO_START))


def checkpoint_dims(model_dir: str | Path) -> ModelDims:
    """ModelDims of a checkpoint directory: its config.json and its chat template's
    :func:`template_video_start`."""
    return model_dims(read_config(model_dir), video_start=template_video_start(model_dir))


def preset_name(name: str) -> str:
    """The :data:`MODEL_PRESETS` name of ``name``, which may also be spelled as the config
    presets spell the model (``qwen2_5_vl_7b``, or a config's name, ``qwen2_5_vl_7b_8gpu``);
    ValueError naming the allowed names."""
    if name in MODEL_PRESETS:
        return name
    spelled = re.sub(r"(\d)-(\d)", r"\1.\2",
                     re.sub(r"_\d+gpu$", "", name.strip().lower()).replace("_", "-"))
    if spelled in MODEL_PRESETS:
        return spelled
    raise ValueError(f"unknown model preset {name!r}; allowed: {', '.join(MODEL_PRESETS)} (or "
                     "the configs' spelling, e.g. qwen2_5_vl_7b_8gpu)")


def preset_dims(name: str) -> ModelDims:
    """The sizes of model preset ``name`` (:func:`preset_name`: either spelling)."""
    return MODEL_PRESETS[preset_name(name)]


def video_grid(frames: int, height: int, width: int, *, patch_size: int = 14,
               max_pixels: int | None = None, min_pixels: int | None = None,
               ) -> tuple[int, int, int]:
    """(temporal patches, merged-token rows, merged-token cols) of ``frames`` sampled frames of
    height x width, by the runtime's rules (:func:`apbv.video.plan_sampling`: qwen-vl-utils'
    smart_resize with the default video pixel limits, which cap a frame at 768 tokens)."""
    spec = VideoSpec("planned-video", nframes=frames, max_pixels=max_pixels,
                     min_pixels=min_pixels, image_patch_size=patch_size)
    sampling = plan_sampling(spec, VideoMeta(frames, 2.0, height, width))
    t, h, w = sampling.grid_thw
    return t, h // 2, w // 2  # qwen-vl-utils sizes frames for a 2 x 2 spatial merge


def video_context_len(dims: ModelDims, patches: int, grid: tuple[int, int]) -> int:
    """Context tokens of a prompt holding ``patches`` temporal patches of rows x cols ``grid``
    tokens: the template's ``dims.video_start`` tokens, the video tokens with
    ``dims.unit_text_tokens`` between patches, and what closes the video (Qwen2.5-VL:
    ``<|vision_end|>``; InternVL3: ``</img>`` and a new line)."""
    if dims.video_start is None:
        raise ValueError("a prompt with video needs video_start (the context tokens before the "
                         "video): the sizes of a checkpoint, whose chat template gives them")
    tokens = patches * grid[0] * grid[1]
    if dims.unit_text_tokens:
        return dims.video_start + tokens + (patches - 1) * dims.unit_text_tokens + \
            INTERNVL_VIDEO_END
    return dims.video_start + tokens + 1


def squarest_grid(tokens_per_patch: int) -> tuple[int, int]:
    """(rows, cols) with rows * cols = tokens_per_patch and rows the largest divisor <= sqrt."""
    rows = max(d for d in range(1, math.isqrt(tokens_per_patch) + 1) if tokens_per_patch % d == 0)
    return rows, tokens_per_patch // rows


def split_window(length: int, window: int) -> list[int]:
    """Edges of the vision attention windows along one axis of ``length`` merged tokens."""
    return [window] * (length // window) + ([length % window] if length % window else [])


def _flops(shapes: list[tuple[int, int]]) -> int:
    return sum(2 * d_in * d_out for d_in, d_out in shapes)


def _weights(shapes: list[tuple[int, int]]) -> int:
    return sum(d_in * d_out for d_in, d_out in shapes)

