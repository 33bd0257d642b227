"""A checkpoint as a user's own fine-tune would be: the tiny model and its processor loaded and
written again with the installed transformers' own ``save_pretrained`` (with transformers 5: one
``processor_config.json``, no ``preprocessor_config.json``, the template in
``chat_template.jinja``)."""

from __future__ import annotations

from pathlib import Path


def save_with_transformers(source: Path, out: Path) -> Path:
    """``source`` (a checkpoint directory) loaded and saved to ``out`` by transformers."""
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(source, local_files_only=True)
    model.save_pretrained(out)
    AutoProcessor.from_pretrained(source, local_files_only=True).save_pretrained(out)
    return out
