"""The prompt's token ids: the checkpoint's own chat template, context and query tokenized apart.

The chat template renders one user turn holding the video and the question:

    <|im_start|>system ... <|im_end|>\\n<|im_start|>user\\n<|vision_start|><|video_pad|><|vision_end|>
    QUESTION<|im_end|>\\n<|im_start|>assistant\\n

The context is everything before the question (N tokens, with the video placeholder expanded to
one token per merged video patch, as the processor does); the query is the question and the
assistant header (Q tokens). They are tokenized separately and concatenated, so the split never
depends on how BPE merges across the boundary.
"""

from __future__ import annotations

from typing import Any

import torch

VIDEO_PAD = "<|video_pad|>"
VISION_END = "<|vision_end|>"


def split_prompt(processor: Any, question: str) -> tuple[str, str]:
    """(context text with one video placeholder, query text) from the chat template."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError("the question must be a non-empty string")
    messages = [{"role": "user", "content": [{"type": "video"},
                                             {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if text.count(VIDEO_PAD) != 1 or VISION_END not in text:
        raise ValueError(f"the chat template must place one {VIDEO_PAD} placeholder before the "
                         f"question; it rendered {text!r}")
    cut = text.index(question, text.index(VISION_END))
    return text[:cut], text[cut:]


def prompt_ids(
    tokenizer: Any, context_text: str, query_text: str, num_video_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Context ids (N,) with ``num_video_tokens`` video placeholders, and query ids (Q,)."""
    expanded = context_text.replace(VIDEO_PAD, VIDEO_PAD * num_video_tokens)
    context = tokenizer(expanded, add_special_tokens=False)["input_ids"]
    query = tokenizer(query_text, add_special_tokens=False)["input_ids"]
    return torch.tensor(context, dtype=torch.long), torch.tensor(query, dtype=torch.long)
