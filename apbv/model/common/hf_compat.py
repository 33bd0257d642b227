"""Every difference between the transformers versions apbv runs on, in one place.

Tested: transformers 4.57.x, 5.17.x and 5.24.x (``bash scripts/compat.sh VERSION``). Drift, and
where it is handled:

- vision tower: 5.x returns a model output with the merged embeddings as ``pooler_output``,
  4.x the tensor itself (:func:`tower_output`);
- RoPE settings: 5.x keeps them in ``rope_parameters`` (with ``rope_theta``), 4.x in
  ``rope_scaling`` (``mrope_section``) next to a ``rope_theta`` attribute (:func:`rope_config`,
  :func:`rope_settings`); 5.x reads 4.x's keys, and :func:`load_config` makes 4.x read 5.x's;
- tokenizer: 5.x loads ``Qwen2Tokenizer`` (tokenizers-backed), 4.x ``Qwen2TokenizerFast``
  (:data:`TOKENIZER_CLASS`);
- video processor: 5.x takes ``cap_pixels_per_frame`` (and warns without it), 4.57 does not
  know it (:func:`video_processor_kwargs`). The per-frame pixel cap of qwen-vl-utils is applied
  by :mod:`apbv.video` when it resizes the frames, so processing already-resized frames
  (:meth:`apbv.model.qwen2_5_vl.adapter.QwenVL.process_frames`) gives the same patches on every
  version;
- ``from_pretrained``'s dtype argument: ``dtype`` (``torch_dtype`` before 4.56,
  :func:`dtype_kwargs`);
- attention registry: ``AttentionInterface.register`` (:mod:`apbv.model.common.hook`); an
  implementation the mask registry does not know gets no mask built, on 4.57 as on 5.x;
- vision attention: 5.x hands the packed sequence of a block with its ``cu_seqlens`` (one call
  per block) to every implementation whose name contains "flash", hence the name of
  :data:`apbv.model.common.hook.VISION_ATTN_IMPLEMENTATION`; 4.57 does so only for
  ``flash_attention_2`` and calls ours once per window, which stays exact but is not grouped.
  The implementation is set on the loaded vision config
  (:func:`apbv.model.common.tower.set_vision_attention`), not passed to ``from_pretrained``, whose
  checks would treat the name as a flash-attn kernel to fetch;
- vision rotary: 4.57 and 5.x call the module-level ``apply_rotary_pos_emb_vision`` of the
  modeling module at every block, which :func:`apbv.model.common.tower.set_vision_rotary` replaces
  (a version without it keeps its own rotary: :func:`module_function`);
- 5.24's ``get_rope_index`` resumes text after a video at a different position than the rule
  the checkpoints were trained with; we never let the model compute positions
  (see :mod:`apbv.positions`);
- Qwen3-VL's video prompt: from 5.10.1 the stock processor expands a video inside the chat
  template's own ``<|vision_start|>`` ... ``<|vision_end|>``, which apbv's prompt follows token
  for token; 4.57.x to 5.9.0 replaced those three tokens whole, so Qwen3-VL is refused there
  (:func:`check_qwen3_vl_version`; the other families run on the whole range).
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import AutoConfig, PretrainedConfig

SUPPORTED_TRANSFORMERS = ">=4.57,<5.25"
TRANSFORMERS_VERSION = Version(transformers.__version__)
V5 = TRANSFORMERS_VERSION.major >= 5
TOKENIZER_CLASS = "Qwen2Tokenizer" if V5 else "Qwen2TokenizerFast"
"""Class name of the tokenizer ``AutoProcessor`` loads for a Qwen2.5-VL checkpoint."""


def check_version() -> None:
    """Raise ValueError naming the supported range when this transformers is too old."""
    if TRANSFORMERS_VERSION < Version("4.57"):
        raise ValueError(f"transformers {transformers.__version__} is too old: apbv needs "
                         f"transformers{SUPPORTED_TRANSFORMERS}")


QWEN3_VL_TRANSFORMERS = "5.10.1"
"""The lowest transformers whose Qwen3-VL processor lays a video out as apbv's prompt does
(checked in each release's ``processing_qwen3_vl.py``: 5.9.0 and earlier replace the
template's ``<|vision_start|><|video_pad|><|vision_end|>`` whole)."""


def check_qwen3_vl_version() -> None:
    """ValueError naming the installed and the needed transformers when Qwen3-VL's prompts
    would differ from this transformers' stock processor's."""
    if TRANSFORMERS_VERSION < Version(QWEN3_VL_TRANSFORMERS):
        raise ValueError(f"Qwen3-VL needs transformers>={QWEN3_VL_TRANSFORMERS} (this is "
                         f"{TRANSFORMERS_VERSION}, whose processor lays a video's timestamps "
                         "out differently from the prompts apbv builds); the other families "
                         f"run on transformers{SUPPORTED_TRANSFORMERS}")


def rope_config(mrope_section: list[int], rope_theta: float) -> dict[str, Any]:
    """The text-config keys that set M-RoPE (``mrope_section``: temporal, height, width
    frequency sections summing to head_dim / 2) in this transformers version."""
    if V5:
        return {"rope_parameters": {"rope_type": "default", "mrope_section": list(mrope_section),
                                    "rope_theta": rope_theta}}
    return {"rope_scaling": {"rope_type": "default", "mrope_section": list(mrope_section)},
            "rope_theta": rope_theta}


def rope_settings(text_config: Any) -> dict[str, Any]:
    """``{"rope_type", "mrope_section", "rope_theta"}`` of a loaded text config, any version
    (the legacy ``type`` key some configs carry is dropped)."""
    if V5:
        params = dict(text_config.rope_parameters or {})
    else:
        params = dict(text_config.rope_scaling or {})
        params["rope_theta"] = text_config.rope_theta
    params.setdefault("rope_type", params.get("type", "default"))
    return {key: params.get(key) for key in ("rope_type", "mrope_section", "rope_theta")}


def video_processor_kwargs(video_processor: Any) -> dict[str, Any]:
    """Arguments every video-processor call gets: the per-frame pixel cap of qwen-vl-utils
    where the processor has the switch (5.x; without it 5.x warns and does not cap)."""
    known = getattr(getattr(video_processor, "valid_kwargs", None), "__annotations__", {})
    if "cap_pixels_per_frame" in known:
        return {"cap_pixels_per_frame": True}
    return {}


def dtype_kwargs(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """``from_pretrained``'s dtype argument under its name in this version."""
    return {"dtype" if TRANSFORMERS_VERSION >= Version("4.56") else "torch_dtype": dtype}


def load_config(path: str | Path) -> PretrainedConfig:
    """The checkpoint's config (its ``model_type``'s class); on 4.x a config saved by 5.x
    (``rope_parameters``, no ``rope_scaling``) gets its M-RoPE settings moved to the keys 4.x
    reads."""
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    text = config.text_config
    params = getattr(text, "rope_parameters", None)
    if not V5 and text.rope_scaling is None and isinstance(params, dict):
        text.rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        text.rope_theta = params.get("rope_theta", text.rope_theta)
        del text.rope_parameters
    return config


def tower_output(out: Any) -> torch.Tensor:
    """The merged embeddings (n_tokens, hidden) a vision tower call returned: the tensor
    itself (4.x) or a model output's ``pooler_output`` (5.x)."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def module_function(module: types.ModuleType, name: str) -> Any:
    """The module-level function ``name`` of a modeling module, or None where this version
    has none (then apbv keeps the version's own code path)."""
    return getattr(module, name, None)
