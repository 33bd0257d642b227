"""The prompt's token ids: the checkpoint's own chat template, context and query tokenized apart.

The chat template renders one user turn holding the video and the question:

    <|im_start|>system ... <|im_end|>\\n<|im_start|>user\\n
    <|vision_start|><|video_pad|><|vision_end|>QUESTION<|im_end|>\\n<|im_start|>assistant\\n

The context is everything before the question (N tokens, with the video placeholder expanded to
one token per merged video patch, as the processor does); the query is the question and the
assistant header (Q tokens). They are tokenized separately and concatenated, so the split never
depends on how BPE merges across the boundary.

The question is data, never control: it is tokenized with special-token strings split into
plain text, so a question holding ``<|im_end|>`` or ``<|video_pad|>`` cannot end the user's
turn, open another role or add a video placeholder. The template's own markers around it stay
control tokens.
"""

from __future__ import annotations

from typing import Any

import torch

VIDEO_PAD = "<|video_pad|>"
VISION_END = "<|vision_end|>"
_SENTINEL = "\u2063apbv-question\u2063"  # stands in for the question while rendering


def split_prompt(processor: Any, question: str) -> tuple[str, str]:
    """(context text with one video placeholder, query text) from the chat template.

    The template is rendered around a sentinel, not the question, so nothing the question
    holds can change where the video placeholder or the turn markers go.
    """
    if not isinstance(question, str) or not question.strip():
        raise ValueError("the question must be a non-empty string")
    messages = [{"role": "user", "content": [{"type": "video"},
                                             {"type": "text", "text": _SENTINEL}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if text.count(VIDEO_PAD) != 1 or text.count(_SENTINEL) != 1 or \
            text.find(VISION_END) > text.find(_SENTINEL):
        raise ValueError(f"the chat template must place one {VIDEO_PAD} placeholder before the "
                         f"question; it rendered {text!r}")
    cut = text.index(_SENTINEL)
    return text[:cut], question + text[cut + len(_SENTINEL):]


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of user text in which special-token strings are plain text."""
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    control = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    if control.intersection(ids):  # a tokenizer that ignored split_special_tokens
        raise ValueError("the tokenizer turned special-token text of the question into control "
                         "tokens; refusing the question")
    return ids


def prompt_ids(
    tokenizer: Any, context_text: str, query_text: str, question: str, num_video_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Context ids (N,) with ``num_video_tokens`` video placeholders, and query ids (Q,).

    ``query_text`` starts with ``question`` (as :func:`split_prompt` returns it); the question
    is tokenized as plain text (:func:`text_ids`), the template's rest with its control tokens.
    """
    assert query_text.startswith(question), (query_text[:80], question[:80])
    # The placeholder is a special token, so the text on either side tokenizes apart: build
    # the video span's ids directly instead of tokenizing tens of thousands of placeholders.
    before, after = context_text.split(VIDEO_PAD)
    pad = tokenizer.convert_tokens_to_ids(VIDEO_PAD)
    context = (tokenizer(before, add_special_tokens=False)["input_ids"]
               + [pad] * num_video_tokens
               + tokenizer(after, add_special_tokens=False)["input_ids"])
    tail = tokenizer(query_text[len(question):], add_special_tokens=False)["input_ids"]
    query = text_ids(tokenizer, question) + tail
    return torch.tensor(context, dtype=torch.long), torch.tensor(query, dtype=torch.long)
