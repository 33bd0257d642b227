"""Merging partial attentions by their log-sum-exp (pure math, no communication).

Legend: B batch, T rows, H heads, D head dim. A partial is (out (B, T, H, D), lse (B, H, T) fp32),
the attention of the rows over one subset of the keys. Over the union of disjoint key subsets

    lse = log(exp(lse_a) + exp(lse_b))
    out = (exp(lse_a) * out_a + exp(lse_b) * out_b) / exp(lse)

Computed in the stable form used by ring-flash-attention (the plain form overflows on real
models): out = out_a + sigmoid(lse_b - lse_a) * (out_b - out_a) and lse = logaddexp(lse_a, lse_b),
i.e. lse_a - logsigmoid(lse_a - lse_b). A partial that saw no key has lse = -inf and weight 0;
when neither side saw a key the result stays (out_a, -inf).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def merge_into(
    out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold the partial (out_b, lse_b) into the fp32 accumulator (out, lse); returns the new pair.

    out, out_b: (B, T, H, D); lse, lse_b: (B, H, T) fp32. ``out`` must be fp32.
    """
    assert out.dtype == torch.float32 and lse.dtype == torch.float32, (out.dtype, lse.dtype)
    # Weight of b; NaN only when both lse are -inf, where b must not contribute.
    weight_b = torch.sigmoid(lse_b - lse).nan_to_num(0.0).transpose(1, 2).unsqueeze(-1)
    out = out + weight_b * (out_b.float() - out)
    return out, torch.logaddexp(lse, lse_b)


def merge_partials(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge S >= 1 partials over disjoint key sets.

    Args:
        outs: S tensors (B, T, H, D), any float dtype.
        lses: S tensors (B, H, T) fp32.

    Returns:
        out (B, T, H, D) fp32, lse (B, H, T) fp32.
    """
    assert len(outs) == len(lses) and len(outs) > 0, (len(outs), len(lses))
    out, lse = outs[0].float(), lses[0].float()
    for out_b, lse_b in zip(outs[1:], lses[1:]):
        out, lse = merge_into(out, lse, out_b, lse_b)
    return out, lse


def pack_partial(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """(1, T, H, D) out and (1, H, T) lse -> one (T, H, D + 1) fp32 buffer to send to peers."""
    return torch.cat([out[0].float(), lse[0].T.unsqueeze(-1)], dim=-1)


def merge_packed(gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the (S, T, H, D + 1) stack of :func:`pack_partial` buffers, in order.

    Returns out (1, T, H, D) fp32 and lse (1, H, T) fp32.
    """
    return merge_partials(
        [g[..., :-1].unsqueeze(0) for g in gathered],
        [g[..., -1].T.unsqueeze(0) for g in gathered],
    )
