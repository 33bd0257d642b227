"""Reading a checkpoint's ``config.json`` dict for the cost model: a nested section, a
required field, each missing one a ValueError naming it."""

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
