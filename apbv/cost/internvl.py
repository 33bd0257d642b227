"""InternVL3's sizes for the cost model: its config.json read into :class:`ModelDims` fields,
and the released InternVL3-2B/8B shapes (the ``internvl3-*`` presets).

InternVL3's vision work differs from Qwen2.5-VL's and is modelled as such: InternViT-300M
runs on each frame alone (one frame per temporal unit) as one 448x448 tile of 32x32 patches
of 14 pixels, every block attending over the whole frame (no windows), with a plain GELU MLP
(fc1, fc2); a pixel shuffle at ratio 0.5 makes 16x16 = 256 tokens of 4 * 1024 values, which
the projector (LayerNorm, 4096 -> text hidden, GELU, text hidden -> text hidden) takes to the
decoder's width. The 1025th (class) token of InternViT is left out of the counts (0.1%).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from apbv.cost.config_json import decoder_fields, required, section, template_before_video

INTERNVL_VIDEO_START = 8
"""Context tokens before the first video token in the InternVL3-*-hf chat template (no default
system turn): ``<|im_start|>``, ``user``, a new line, ``Frame``, ``1``, ``:``, a space and
``<img>``. A test derives it from the tiny checkpoint's processor (the released template)."""
INTERNVL_VIDEO_END = 2
"""Context tokens after the last frame's video tokens: ``</img>`` and the new line before the
question."""
INTERNVL_UNIT_TEXT = 7
"""Text tokens per frame between two frames' video tokens: ``</img>``, a new line, ``Frame``,
the frame number (one token per digit: 7 up to frame 9, 8 up to 99), ``:``, a space, ``<img>``."""


def _side(value: Any) -> int:
    """A square size given as an int or [h, w]."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"InternVL3 frames must be square tiles, got {value!r}")
        return int(value[0])
    return int(value)


def internvl_fields(config: Mapping[str, Any], *, video_start: int | None = None,
                    ) -> dict[str, Any]:
    """:class:`apbv.cost.work.ModelDims` fields from an InternVL3 config.json (transformers'
    ``internvl`` form: ``text_config`` and ``vision_config`` nested)."""
    text = section(config, "text_config", "an InternVL3")
    vision = section(config, "vision_config", "an InternVL3")
    decoder = decoder_fields(config, text, "text_config")
    ratio = config.get("downsample_ratio", 0.5)
    merge = round(1 / ratio)
    if abs(merge * ratio - 1) > 1e-9:
        raise ValueError(f"downsample_ratio {ratio} is not 1 / an integer")
    patch = _side(required(vision, "vision_config", "patch_size"))
    side = _side(required(vision, "vision_config", "image_size"))
    return {
        **decoder,
        "vision_depth": required(vision, "vision_config", "num_hidden_layers"),
        "vision_hidden": required(vision, "vision_config", "hidden_size"),
        "vision_intermediate": required(vision, "vision_config", "intermediate_size"),
        "vision_heads": required(vision, "vision_config", "num_attention_heads"),
        "patch_size": patch, "temporal_patch_size": 1, "spatial_merge_size": merge,
        "in_channels": vision.get("num_channels", 3),
        "window_size": side,  # one window: the whole frame
        "fullatt_blocks": required(vision, "vision_config", "num_hidden_layers"),
        "video_start": video_start, "vision_gated": False,
        "projector_hidden": decoder["hidden"],
        "tiled_frames": True, "unit_text_tokens": INTERNVL_UNIT_TEXT,
    }


def released_internvl3(layers: int, hidden: int, heads: int, kv_heads: int,
                       intermediate: int, tied: bool) -> dict[str, Any]:
    """The fields of a released InternVL3-*-hf config.json that :func:`internvl_fields`
    reads. Source: the OpenGVLab InternVL3-2B-hf / InternVL3-8B-hf config.json files on the
    Hugging Face hub (the decoders are Qwen2.5-1.5B and Qwen2.5-7B; the vision tower is
    InternViT-300M-448px-V2_5 in both), vocabulary 151674 (Qwen2.5's plus InternVL's 9
    tokens).

    Checked against public sources (the -hf config.json files themselves were not among
    them): the InternViT-300M shapes (hidden 1024, MLP 4096, 24 layers, 16 heads, 448-pixel
    tiles of 14-pixel patches), ``vocab_size`` 151674 and ``tie_word_embeddings`` false in the
    InternVL3 remote-code config.json files (``internvl_chat``, ``template`` internvl2_5)
    published with InternVL3-1B; 28 decoder layers and 256 tokens per tile for InternVL3-2B
    (radxa-docs, ``aicore/ax-m1/VLM/internvl3-2b.md``); the decoders' shapes are those of
    Qwen2.5-1.5B (28 x 1536, 12 heads, 2 KV heads, MLP 8960) and Qwen2.5-7B (28 x 3584, 28
    heads, 4 KV heads, MLP 18944); the presets' parameter counts match the model cards'
    (tests/unit/test_internvl_cost.py)."""
    return {
        "model_type": "internvl", "downsample_ratio": 0.5, "tie_word_embeddings": tied,
        "text_config": {
            "model_type": "qwen2", "num_hidden_layers": layers, "hidden_size": hidden,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "intermediate_size": intermediate, "vocab_size": 151674,
        },
        "vision_config": {
            "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
            "intermediate_size": 4096, "patch_size": [14, 14], "image_size": [448, 448],
        },
    }


def internvl_video_start(processor: Any) -> int:
    """Context tokens before the first video token under an InternVL3 processor's chat
    template (one user turn: a video, then a question), as the engine's prompt has them
    (:meth:`apbv.model.internvl.adapter.InternVL.prompt_ids`): the template's text before
    ``<video>``, then ``Frame1: <img>``."""
    tokenizer = processor.tokenizer
    before = template_before_video(processor, tokenizer.video_token) + \
        f"Frame1: {tokenizer.start_image_token}"
    return len(tokenizer(before, add_special_tokens=False)["input_ids"])
