"""A tiny random InternVL3 checkpoint (``model_type`` internvl) for tests and demos.

Shaped like InternVL3-2B-hf with small widths: the same head layout (12 query heads over 2 KV
heads in the decoder, the vision tower at 2/3 of the decoder's width with 64-wide heads cut
to 16), frames of 448x448 in 14x14 patches, pixel shuffle at ratio 0.5 (256 tokens per frame),
a two-layer GELU projector, the Qwen2.5 vocabulary with InternVL's added tokens (``<img>``
151665, ``</img>`` 151666, ``<IMG_CONTEXT>`` 151667, ...), and the tokenizer, chat template
and processor files as transformers' InternVL conversion writes them (ImageNet mean and std,
448x448 frames, ``image_seq_length`` 256). Random weights, seeded: the same seed gives the
same weights.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apbv.model.common.qwen_bpe import require_qwen_tokenizer
from apbv.model.qwen2_5_vl.tiny import random_model, write_checkpoint_dir, write_qwen_tokenizer

if TYPE_CHECKING:
    from transformers import InternVLForConditionalGeneration

VOCAB_SIZE = 151674
"""InternVL3-2B's vocabulary: Qwen2.5's 151665 tokens and InternVL's 9 added ones."""
IMAGE_TOKEN_ID = 151667
"""``<IMG_CONTEXT>``: the placeholder each vision embedding replaces."""
INTERNVL_TOKENS = ("<img>", "</img>", "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>", "</ref>",
                   "<box>", "</box>")
"""InternVL's added special tokens, ids 151665 onwards."""
EXTRA_SPECIAL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>",
                        "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
"""The tokenizer's named tokens that transformers' InternVL processor reads."""
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "{{ '<IMG_CONTEXT>\\n' }}{% elif content['type'] == 'video' %}{{ '<video>\\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{'<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n' }}{% endif %}"
)
"""The chat template of the InternVL3-*-hf checkpoints."""
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
FRAME_SIZE = 448


def tiny_internvl_config() -> Any:
    """The tiny InternVL3 configuration (real vocabulary and token ids, tiny widths)."""
    from transformers import InternVLConfig

    text = {
        "model_type": "qwen2", "vocab_size": VOCAB_SIZE, "hidden_size": 96,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 12,
        "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "tie_word_embeddings": False,
    }
    vision = {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 256, "hidden_act": "gelu", "norm_type": "layer_norm",
        "image_size": [FRAME_SIZE, FRAME_SIZE], "patch_size": [14, 14],
        "layer_scale_init_value": 0.1, "use_mean_pooling": True,
    }
    return InternVLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID,
                          image_seq_length=256, downsample_ratio=0.5,
                          projector_hidden_act="gelu", vision_feature_layer=-1,
                          vision_feature_select_strategy="default", tie_word_embeddings=False,
                          dtype="float32")


def build_tiny_internvl(seed: int = 0) -> InternVLForConditionalGeneration:
    """The tiny InternVL3 model in memory (fp32, eval mode), weights drawn from ``seed`` by
    :func:`apbv.model.qwen2_5_vl.tiny.random_model`, the vision blocks' layer scales (``lambda``)
    0.1."""
    from transformers import InternVLForConditionalGeneration

    return random_model(InternVLForConditionalGeneration, tiny_internvl_config(), seed,
                        scales={"lambda": 0.1})


def _processor(directory: Path) -> Any:
    """The InternVL processor of the released checkpoints over the tiny Qwen tokenizer with
    InternVL's added tokens (as transformers' conversion script builds it)."""
    from transformers import (
        AutoTokenizer,
        GotOcr2ImageProcessor,
        InternVLProcessor,
        InternVLVideoProcessor,
    )

    base = directory / "qwen-tokenizer"
    base.mkdir()
    write_qwen_tokenizer(base)
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True,
                                              extra_special_tokens=EXTRA_SPECIAL_TOKENS)
    tokenizer.add_tokens(list(INTERNVL_TOKENS), special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 32768
    size = {"height": FRAME_SIZE, "width": FRAME_SIZE}
    common: dict[str, Any] = {"size": size, "image_mean": IMAGENET_MEAN,
                              "image_std": IMAGENET_STD, "do_rescale": True,
                              "do_normalize": True, "do_convert_rgb": True}
    image = GotOcr2ImageProcessor(crop_to_patches=False, min_patches=1, max_patches=12,
                                  **common)
    video = InternVLVideoProcessor(**common)
    return InternVLProcessor(image_processor=image, tokenizer=tokenizer, video_processor=video,
                             image_seq_length=256, chat_template=CHAT_TEMPLATE)


def write_tiny_internvl(out_dir: str | Path, *, seed: int = 0, overwrite: bool = False) -> Path:
    """Write the tiny InternVL3 checkpoint to ``out_dir`` (absent or empty; with ``overwrite``
    a directory whose content is replaced) and return its absolute path."""
    require_qwen_tokenizer()  # before the model is built
    return write_checkpoint_dir(out_dir, overwrite, lambda out: _write_files(out, seed))


def _write_files(out: Path, seed: int) -> None:
    """The checkpoint's files, written into the directory ``out``."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" for one shard is noise
    build_tiny_internvl(seed).save_pretrained(out)
    with tempfile.TemporaryDirectory() as tmp:
        processor = _processor(Path(tmp))
        assert processor.tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>") == IMAGE_TOKEN_ID
        processor.save_pretrained(out)
