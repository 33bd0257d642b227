"""Reading a checkpoint for the cost model: a nested section and a required field of its
``config.json`` dict, each missing one a ValueError naming it; the decoder's fields, read the
same way for every family; the chat template's text before the video."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def section(config: Mapping[str, Any], name: str, family: str) -> Mapping[str, Any]:
    """``config[name]`` (e.g. ``text_config``); ValueError when it is not there, saying the file
    is then not ``family``'s checkpoint (e.g. "an InternVL3")."""
    found = config.get(name)
    if not isinstance(found, Mapping):
        raise ValueError(f"config.json has no {name}: not {family} checkpoint")
    return found


def required(part: Mapping[str, Any], where: str, *names: str) -> Any:
    """The first of ``names`` in ``part`` (the section called ``where``); ValueError naming
    them when none is there."""
    for name in names:
        if name in part:
            return part[name]
    raise ValueError(f"config.json has no {' or '.join(names)} in {where}")


def decoder_fields(config: Mapping[str, Any], text: Mapping[str, Any],
                   where: str) -> dict[str, Any]:
    """The decoder's :class:`apbv.cost.work.ModelDims` fields from its section ``text`` (called
    ``where``) of ``config``: layers, hidden, heads, kv_heads and head_dim (defaulting as in
    transformers, to the attention heads and hidden / heads), intermediate, vocab (the
    section's, else the top level's) and tied_embeddings (the top level's, else the
    section's); ValueError naming a missing one."""
    heads = required(text, where, "num_attention_heads")
    hidden = required(text, where, "hidden_size")
    vocab = text.get("vocab_size", config.get("vocab_size"))
    if vocab is None:
        raise ValueError(f"config.json has no vocab_size in {where}")
    return {
        "layers": required(text, where, "num_hidden_layers"), "hidden": hidden, "heads": heads,
        "kv_heads": text.get("num_key_value_heads") or heads,
        "head_dim": text.get("head_dim") or hidden // heads,
        "intermediate": required(text, where, "intermediate_size"), "vocab": vocab,
        "tied_embeddings": bool(config.get("tie_word_embeddings",
                                           text.get("tie_word_embeddings", False))),
    }


def template_before_video(processor: Any, video_token: str) -> str:
    """The text a processor's chat template renders before ``video_token`` for one user turn (a
    video, then a question); ValueError when the template does not place the token once."""
    messages = [{"role": "user", "content": [{"type": "video"},
                                             {"type": "text", "text": "What happens?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    if text.count(video_token) != 1:
        raise ValueError(f"the chat template must place one {video_token}; it "
                         f"rendered {text!r}")
    return text[:text.index(video_token)]
