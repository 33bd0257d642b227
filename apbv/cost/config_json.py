"""Reading a checkpoint for the cost model: a nested section and a required field of its
``config.json`` dict, each missing one a ValueError naming it; the chat template's text before
the video."""

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
