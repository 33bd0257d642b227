"""One training batch of the tiny model: a sample's inputs and several samples padded together.

:class:`Encoded` is what :class:`apbv.synthetic.train_tiny.Encoder` builds for one needle
sample; :func:`collate` pads same-kind samples into one batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from apbv.synthetic import byte_tokenizer as bt


@dataclass
class Encoded:
    input_ids: torch.Tensor
    """(1, T) prompt + answer + <|im_end|>."""
    labels: torch.Tensor
    """(1, T) -100 except the answer tokens and <|im_end|>."""
    positions: torch.Tensor
    """(3, 1, T) apbv's M-RoPE positions (answer tokens continue at max + 1)."""
    pixels: torch.Tensor | None
    """The video's patches (None: a text-only sample, :mod:`apbv.synthetic.lookup`)."""
    grid: torch.Tensor | None
    prompt_len: int


def collate(encs: list[Encoded]) -> Encoded:
    """One batch; shorter sequences are padded with <|endoftext|> after their <|im_end|>
    (causal: padding changes no earlier logit). ``prompt_len`` is -1 unless every sample's
    prompt has the same length (the labels mark each one's answer)."""
    if len(encs) == 1:
        return encs[0]
    width = max(e.input_ids.shape[1] for e in encs)
    pad = bt.SPECIAL_IDS["<|endoftext|>"]

    def widen(t: torch.Tensor, value: int) -> torch.Tensor:
        extra = width - t.shape[-1]
        return torch.nn.functional.pad(t, (0, extra), value=value) if extra else t

    ids = torch.cat([widen(e.input_ids, pad) for e in encs])
    labels = torch.cat([widen(e.labels, -100) for e in encs])
    positions = []
    for e in encs:
        extra = width - e.positions.shape[-1]
        more = torch.arange(extra) + int(e.positions.max()) + 1
        positions.append(torch.cat([e.positions, more.view(1, 1, -1).expand(3, 1, -1)], dim=2))
    pixels, grids = [e.pixels for e in encs], [e.grid for e in encs]
    assert all(p is not None for p in pixels + grids), "collate batches video samples"
    return Encoded(ids, labels, torch.cat(positions, dim=1),
                   torch.cat(pixels), torch.cat(grids),  # type: ignore[arg-type]
                   encs[0].prompt_len if len({e.prompt_len for e in encs}) == 1 else -1)
