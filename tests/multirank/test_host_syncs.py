"""Host traffic of the layer loops: prefill and decode build nothing from host data per layer.

On a GPU every tensor built from host data (``torch.tensor``, a ``.to(device)``) is a
host-to-device copy, and every read back (``.item()``, ``int(t)``, ``.tolist()``) waits for
the device: each drains the queue the host should keep ahead of it. These tests count those
calls on the CPU, on 1 and 2 gloo ranks of the tiny model (a spava request, then greedy
decode), by patching the torch entry points while the decoder layers run:

- inside every decoder layer, prefill and decode: none at all;
- a whole decode step (embed, layers, logits, the token's pick and broadcast): nothing built
  from host data and exactly one read back, the new token (for streaming and stop texts).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from apbv.config import RuntimeConfig
from apbv.context import _current
from apbv.distributed import DistInfo, spawn_local
from apbv.engine import runner
from apbv.engine.engine import Engine

QUESTION = "Which colour comes after the blue one?"
NEW_TOKENS = 5

BUILDERS = ("tensor", "as_tensor", "from_numpy")  # torch.* functions that copy host data in
READS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")
MOVES = ("to", "cuda", "cpu")  # Tensor methods; counted when given a device


def _names_device(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.to``/``cuda``/``cpu`` call asks for a device (not only a dtype)."""
    if "device" in kwargs or "other" in kwargs:
        return True
    return bool(args) and isinstance(args[0], (torch.device, str, int, torch.Tensor))


@contextmanager
def counting(where: Callable[[], str | None], model: torch.nn.Module) -> Iterator[Counter]:
    """Count host-data builds (``build``), device moves (``move``) and reads back (``read``)
    by phase: ``where()`` names the phase of a call, or None to not count it. The model's own
    parameters and buffers are on its device already: their ``.to(device)`` (HF's rotary
    embedding asks for its ``inv_freq`` on every forward) is a no-op on any device."""
    counts: Counter = Counter()
    saved: list[tuple[Any, str, Any]] = []
    resident = {id(t) for t in (*model.parameters(), *model.buffers())}

    def patch(owner: Any, name: str, kind: str, device_only: bool = False) -> None:
        original = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            phase = where()
            moves = not device_only or (_names_device(args[1:], kwargs)
                                        and id(args[0]) not in resident)
            if phase is not None and moves:
                counts[phase, kind, name] += 1
            return original(*args, **kwargs)

        saved.append((owner, name, original))
        setattr(owner, name, counted)

    for name in BUILDERS:
        patch(torch, name, "build")
    for name in READS:
        patch(torch.Tensor, name, "read")
    for name in MOVES:
        patch(torch.Tensor, name, "move", device_only=True)
    try:
        yield counts
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _traffic_job(info: DistInfo, cfg: RuntimeConfig, video: str) -> dict:
    engine = Engine(cfg, info)
    layers = engine.model.model.model.language_model.layers
    state = {"layer": False, "decode": False, "steps": 0}

    def where() -> str | None:
        phase = type(_current.get()).__name__  # PrefillContext or DecodeContext
        if state["layer"]:
            return f"{phase} layer"
        return "decode step" if state["decode"] else None

    def enter(*_: Any) -> None:
        state["layer"] = True

    def leave(*_: Any) -> None:
        state["layer"] = False

    hooks = [h for layer in layers for h in (layer.register_forward_pre_hook(enter),
                                             layer.register_forward_hook(leave))]
    greedy = runner.greedy_continue

    def decoding(*args: Any, **kwargs: Any) -> Any:
        state["decode"] = True
        try:
            answer = greedy(*args, **kwargs)
        finally:
            state["decode"] = False
        state["steps"] += len(answer.tokens) - 1
        return answer

    runner.greedy_continue = decoding
    try:
        with counting(where, engine.model.model) as counts:
            result = engine.generate(engine.request(video, QUESTION, mode="spava",
                                                    max_new_tokens=NEW_TOKENS))
    finally:
        runner.greedy_continue = greedy
        for hook in hooks:
            hook.remove()
    return {"counts": dict(counts), "steps": state["steps"], "tokens": result.token_ids,
            "layers": len(layers)}


@pytest.mark.parametrize("world_size", [1, 2])
def test_layer_loops_and_decode_steps_build_nothing_from_host_data(
        world_size: int, tiny_config: RuntimeConfig, short_video: Path) -> None:
    per_rank = spawn_local(_traffic_job, world_size, (tiny_config, str(short_video)),
                           timeout_s=300, collective_timeout_s=120)
    for rank, r in enumerate(per_rank):
        counts, steps = Counter(r["counts"]), r["steps"]
        assert steps >= 2, r  # the check needs decode steps to count
        assert r["tokens"] == per_rank[0]["tokens"]
        in_layers = {key: n for key, n in counts.items() if key[0].endswith(" layer")}
        assert not in_layers, f"rank {rank}: host traffic inside decoder layers: {in_layers}"
        step = {key: n for key, n in counts.items() if key[0] == "decode step"}
        built = {key: n for key, n in step.items() if key[1] != "read"}
        assert not built, f"rank {rank}: {steps} decode steps built from host data: {built}"
        reads = sum(n for key, n in step.items() if key[1] == "read")
        assert reads == steps, (
            f"rank {rank}: {reads} reads back in {steps} decode steps (one token each): {step}")
