"""The prompt's token ids: the checkpoint's own chat template, context and query tokenized apart.

The chat template renders one user turn holding the video and the question:

    <|im_start|>system ... <|im_end|>\\n<|im_start|>user\\n
    <|vision_start|><|video_pad|><|vision_end|>QUESTION<|im_end|>\\n<|im_start|>assistant\\n

The context is everything before the question (N tokens, with the video placeholder expanded to
one token per merged video patch, as the processor does); the query is the question and the
assistant header (Q tokens). They are tokenized separately and concatenated, so the split never
depends on how BPE merges across the boundary.

A system text (a chat request's system message) goes into the template's system turn, in place
of the template's default ("You are a helpful assistant." in Qwen2.5-VL's); it is part of the
context, before the video.

The question and the system text are data, never control: they are tokenized with special-token
strings split into plain text, so text holding ``<|im_end|>`` or ``<|video_pad|>`` cannot end
its turn, open another role or add a video placeholder. The template's own markers around them
stay control tokens.
"""

from __future__ import annotations

from typing import Any

import torch

VIDEO_PAD = "<|video_pad|>"
VISION_END = "<|vision_end|>"
_SENTINEL = "\u2063apbv-question\u2063"  # stands in for the question while rendering
SYSTEM_SLOT = "\u2063apbv-system\u2063"
"""Stands for the system text in the context text of :func:`split_prompt`;
:func:`prompt_ids` puts the system text's plain-text tokens there."""


def split_prompt(processor: Any, question: str,
                 system: str | None = None) -> tuple[str, str]:
    """(context text with one video placeholder, query text) from the chat template; with a
    ``system`` text, the context holds :data:`SYSTEM_SLOT` in the template's system turn, where
    :func:`prompt_ids` (given the same ``system``) puts its tokens.

    The template is rendered around sentinels, not the client's text, so nothing the question
    or the system text holds can change where the video placeholder or the turn markers go.
    """
    if not isinstance(question, str) or not question.strip():
        raise ValueError("the question must be a non-empty string")
    if system is not None and not isinstance(system, str):
        raise ValueError(f"the system text must be a string, got {type(system).__name__}")
    messages = [{"role": "user", "content": [{"type": "video"},
                                             {"type": "text", "text": _SENTINEL}]}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": [{"type": "text", "text": SYSTEM_SLOT}]})
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if text.count(VIDEO_PAD) != 1 or text.count(_SENTINEL) != 1 or \
            text.find(VISION_END) > text.find(_SENTINEL):
        raise ValueError(f"the chat template must place one {VIDEO_PAD} placeholder before the "
                         f"question; it rendered {text!r}")
    if system is not None and (text.count(SYSTEM_SLOT) != 1 or
                               text.find(SYSTEM_SLOT) > text.find(VIDEO_PAD)):
        raise ValueError("the chat template must place a system message once, before the "
                         f"video; it rendered {text!r}")
    cut = text.index(_SENTINEL)
    return text[:cut], question + text[cut + len(_SENTINEL):]


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of user text in which special-token strings are plain text."""
    if not text:
        return []
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    control = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    if control.intersection(ids):  # a tokenizer that ignored split_special_tokens
        raise ValueError("the tokenizer turned special-token text of the client's text (a "
                         "question, system text or choice) into control tokens; refusing it")
    return ids


def _template_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of the template's own text (its markers are control tokens)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def prompt_ids(
    tokenizer: Any, context_text: str, query_text: str, question: str, num_video_tokens: int,
    system: str | None = None, video_ids: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Context ids (N,) with ``num_video_tokens`` video placeholders, and query ids (Q,);
    ``video_ids``: the ids that stand in the placeholder's place instead (a family whose
    processor expands it into more than placeholders, e.g. Qwen3-VL's timestamps).

    ``query_text`` starts with ``question`` and ``context_text`` holds :data:`SYSTEM_SLOT`
    when ``system`` is given (as :func:`split_prompt` returns them); the question and the
    system text are tokenized as plain text (:func:`text_ids`), the template's rest with its
    control tokens.
    """
    assert query_text.startswith(question), (query_text[:80], question[:80])
    assert context_text.count(SYSTEM_SLOT) == (system is not None), \
        "split_prompt and prompt_ids were given different system texts"
    # The placeholder is a special token, so the text on either side tokenizes apart: build
    # the video span's ids directly instead of tokenizing tens of thousands of placeholders.
    before, after = context_text.split(VIDEO_PAD)
    head, _, rest = before.rpartition(SYSTEM_SLOT)
    pad = tokenizer.convert_tokens_to_ids(VIDEO_PAD)
    context = (_template_ids(tokenizer, head)
               + ([] if system is None else text_ids(tokenizer, system))
               + _template_ids(tokenizer, rest)
               + ([pad] * num_video_tokens if video_ids is None else video_ids)
               + _template_ids(tokenizer, after))
    tail = _template_ids(tokenizer, query_text[len(question):])
    query = text_ids(tokenizer, question) + tail
    return torch.tensor(context, dtype=torch.long), torch.tensor(query, dtype=torch.long)


def build_prompt(processor: Any, question: str, num_video_tokens: int,
                 system: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Context ids (N,) with ``num_video_tokens`` video placeholders and query ids (Q,) of the
    checkpoint's chat template around ``question`` (and ``system``): :func:`split_prompt`
    then :func:`prompt_ids`, the one way every caller builds a prompt."""
    context_text, query_text = split_prompt(processor, question, system)
    return prompt_ids(processor.tokenizer, context_text, query_text, question, num_video_tokens,
                      system)
