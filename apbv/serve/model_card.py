"""What ``GET /v1/models`` says of the served model, as vLLM says it: ``created`` (the server's
start, Unix seconds), ``max_model_len`` (the most tokens one request may hold: its prompt,
video included, and its answer) and ``root`` / ``parent``.

``max_model_len`` is ``--max-prompt-tokens`` + ``--max-tokens``, capped by the checkpoint's
``max_position_embeddings`` (its text model's); a benchmark tool that sizes its requests from
it gets requests the server admits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from apbv.openai.policy import Limits


def checkpoint_positions(model_dir: str | None) -> int | None:
    """The checkpoint's ``max_position_embeddings`` (``text_config``'s where it has one), or
    None when its config.json is missing, unreadable or without it."""
    if not model_dir:
        return None
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    positions = text.get("max_position_embeddings") or config.get("max_position_embeddings")
    return positions if isinstance(positions, int) and positions > 0 else None


def max_model_len(limits: Limits, positions: int | None) -> int:
    """Prompt plus answer tokens one request may hold (see the module docstring)."""
    total = limits.max_prompt_tokens + limits.max_tokens
    return total if positions is None else min(total, positions)


def model_card(name: str, created: int, max_len: int, family: str | None) -> dict[str, Any]:
    """One entry of ``/v1/models``' ``data``."""
    card: dict[str, Any] = {"id": name, "object": "model", "created": created,
                            "owned_by": "apbv", "root": name, "parent": None,
                            "max_model_len": max_len}
    if family is not None:
        card["family"] = family
    return card
