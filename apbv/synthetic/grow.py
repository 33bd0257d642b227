"""Grow a trained tiny model by decoder layers without changing any of its answers.

``train-tiny --init DIR --grow N`` (:mod:`apbv.synthetic.train_tiny`) appends ``N`` decoder
layers to the checkpoint's language model, after its own and before the final norm. Each new
layer's output projections (attention ``o_proj``, MLP ``down_proj``) start at zero, so the
residual stream, and every logit, is bit-identical to the checkpoint's at step 0; the config
differs only in ``num_hidden_layers`` (and its per-layer lists), so the grown model is the
same stock ``Qwen2_5_VLForConditionalGeneration`` loaded by ``from_pretrained``. The old
weights (vision tower, old layers, tied embeddings) train at ``--old-lr-scale`` times the
rate (0 freezes them: backward then stops at the first new layer).

:func:`probe` is the short held-out letter check the trainer prints while it trains.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, TextIO

import torch

from apbv.synthetic import mix


def grown(model_cls: Any, start: Any, extra: int, seed: int) -> Any:
    """``start`` (a loaded fp32 model) with ``extra`` decoder layers appended, their output
    projections zero (the same logits as ``start``'s); new weights seeded by ``seed``."""
    if isinstance(extra, bool) or not isinstance(extra, int) or extra < 1:
        raise ValueError(f"grow must be a positive number of layers, got {extra!r}")
    config = copy.deepcopy(start.config)
    text = config.text_config
    old = int(text.num_hidden_layers)
    text.num_hidden_layers = old + extra
    text.layer_types = list(text.layer_types) + [text.layer_types[-1]] * extra
    text.max_window_layers = old + extra
    torch.manual_seed(seed)
    model = model_cls(config).float()
    missing, unexpected = model.load_state_dict(start.state_dict(), strict=False)
    new_prefixes = tuple(f"layers.{i}." for i in range(old, old + extra))
    assert not unexpected and all(any(p in k for p in new_prefixes) for k in missing), \
        (missing, unexpected)
    with torch.no_grad():
        for layer in decoder_layers(model)[old:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def decoder_layers(model: Any) -> Any:
    """The language model's decoder layers (a ModuleList)."""
    return model.model.language_model.layers


def param_groups(model: Any, new: int, old_scale: float) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: the last ``new`` decoder layers at the full rate,
    every other parameter at ``old_scale`` times it (0: frozen, ``requires_grad`` False, so
    backward stops at the first new layer; the trainer multiplies each group's ``scale``)."""
    if not 0 <= old_scale <= 1:
        raise ValueError(f"old_lr_scale must be in [0, 1], got {old_scale!r}")
    layers = decoder_layers(model)
    assert 0 <= new <= len(layers), new
    fresh = [p for layer in layers[len(layers) - new:] for p in layer.parameters()]
    ids = {id(p) for p in fresh}
    old = [p for p in model.parameters() if id(p) not in ids]
    if old_scale == 0:
        for p in old:
            p.requires_grad_(False)
        return [{"params": fresh, "scale": 1.0}]
    return [{"params": fresh, "scale": 1.0}, {"params": old, "scale": old_scale}]


PROBE_SETS = ("choice/vnbench/retrieval", "choice/vnbench/counting",
              "choice/longvideobench/retrieval", "choice/longvideobench/counting",
              "choice/longvideobench/presence", "free/presence", "free/retrieval")
"""What :func:`probe` asks: the letters the needle fixtures ask, and two free-form kinds
(which must keep their word answers)."""


def probe(answers: Callable[[mix.Task], bool], seed: int, patches: int = 64, samples: int = 8,
          form: str = "choice") -> dict[str, float]:
    """{set: accuracy} of ``samples`` held-out tasks of each :data:`PROBE_SETS` entry (asked
    in answer ``form``: :func:`apbv.synthetic.mix.as_form`) at ``patches`` temporal patches;
    ``answers(task)`` tells whether the model is right."""
    with torch.no_grad():
        return {entry: sum(answers(t) for t in mix.heldout_tasks(entry, patches, samples,
                                                                 seed, False)) / samples
                for entry in (mix.as_form(e, form) for e in PROBE_SETS)}


def print_probe(step: int, result: dict[str, float], out: TextIO) -> None:
    cells = "  ".join(f"{k.split('/', 1)[1]} {v:.2f}" for k, v in result.items())
    print(f"probe @ {step}: {cells}", file=out, flush=True)
