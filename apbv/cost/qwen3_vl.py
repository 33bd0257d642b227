"""Qwen3-VL's sizes for the cost model: its config.json read into :class:`ModelDims` fields, and
the released Qwen3-VL-8B-Instruct shapes (the ``qwen3-vl-8b`` preset).

Qwen3-VL's vision tower (SigLIP-2 style, 27 blocks in the 8B) takes 2-frame temporal patches of
16x16 pixels and attends over the whole temporal patch in every block (no windows), with a plain
GELU MLP (fc1, fc2); a 2x2 merger (LayerNorm, wide -> wide, GELU, wide -> text hidden) makes
the tokens. DeepStack adds one more merger per ``deepstack_visual_indexes`` entry (3 in the 8B),
whose features travel with each token's embedding to its rank: each level adds a merger's work
and a row of ``hidden`` values to the embeddings held and moved (``deepstack_levels``). The
prompt puts ``<t seconds>`` text and its own ``<|vision_start|>`` / ``<|vision_end|>`` around
every temporal patch's tokens (:data:`QWEN3_VL_UNIT_TEXT`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from apbv.cost.config_json import decoder_fields, required, section, template_before_video

QWEN3_VL_VIDEO_START = 11
"""Context tokens before the first video token in the Qwen3-VL-Instruct chat template (no
default system turn): ``<|im_start|>``, ``user``, a new line, the template's
``<|vision_start|>``, the first patch's ``<0.x seconds>`` (6 tokens: ``<``, digit, ``.``,
digit, `` seconds``, ``>``) and its ``<|vision_start|>``. A test derives it from the tiny
checkpoint's processor (the released template)."""
QWEN3_VL_UNIT_TEXT = 9
"""Text tokens between two temporal patches' video tokens: ``<|vision_end|>``, the timestamp
(6 tokens below 10 s, 7 up to 100 s, 8 up to 1000 s) and ``<|vision_start|>``."""


def qwen3_vl_fields(config: Mapping[str, Any], *, video_start: int | None = None,
                    ) -> dict[str, Any]:
    """:class:`apbv.cost.work.ModelDims` fields from a Qwen3-VL config.json (``text_config``
    and ``vision_config`` nested, as released and as transformers saves it)."""
    text = section(config, "text_config", "a Qwen3-VL")
    vision = section(config, "vision_config", "a Qwen3-VL")
    decoder = decoder_fields(config, text, "text_config")
    hidden = decoder["hidden"]
    out_hidden = vision.get("out_hidden_size", hidden)
    if out_hidden != hidden:
        raise ValueError(f"vision_config.out_hidden_size ({out_hidden}) differs from the text "
                         f"hidden_size ({hidden})")
    depth = required(vision, "vision_config", "depth")
    return {
        **decoder,
        "vision_depth": depth,
        "vision_hidden": required(vision, "vision_config", "hidden_size"),
        "vision_intermediate": required(vision, "vision_config", "intermediate_size"),
        "vision_heads": required(vision, "vision_config", "num_heads"),
        "patch_size": required(vision, "vision_config", "patch_size"),
        "temporal_patch_size": required(vision, "vision_config", "temporal_patch_size"),
        "spatial_merge_size": required(vision, "vision_config", "spatial_merge_size"),
        "in_channels": vision.get("in_channels", 3),
        "fullatt_blocks": depth,  # every block attends over the whole temporal patch
        "video_start": video_start, "vision_gated": False,
        "unit_text_tokens": QWEN3_VL_UNIT_TEXT,
        "deepstack_levels": len(vision.get("deepstack_visual_indexes") or ()),
    }


def released_qwen3_vl_8b() -> dict[str, Any]:
    """The fields of Qwen3-VL-8B-Instruct's config.json that :func:`qwen3_vl_fields` reads
    (the Qwen/Qwen3-VL-8B-Instruct config.json on the Hugging Face hub: a Qwen3-8B decoder of
    36 layers, 32 query and 8 KV heads of 128, M-RoPE sections [24, 20, 20] interleaved; a
    27-block vision tower of width 1152 with DeepStack after blocks 8, 16 and 24)."""
    return {
        "model_type": "qwen3_vl", "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_vl_text", "num_hidden_layers": 36, "hidden_size": 4096,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 12288, "vocab_size": 151936,
        },
        "vision_config": {
            "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
            "in_channels": 3, "out_hidden_size": 4096, "patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2,
            "deepstack_visual_indexes": [8, 16, 24],
        },
    }


def qwen3_vl_video_start(processor: Any) -> int:
    """Context tokens before the first video token under a Qwen3-VL processor's chat template
    (one user turn: a video, then a question), as the engine's prompt has them: the
    template's text before ``<|video_pad|>``, then the first patch's timestamp and
    ``<|vision_start|>``."""
    tokenizer = processor.tokenizer
    before = template_before_video(processor, processor.video_token) + \
        f"<0.5 seconds>{processor.vision_start_token}"
    return len(tokenizer(before, add_special_tokens=False)["input_ids"])
