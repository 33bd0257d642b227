"""Single-process, dense-mask oracle of APB-V attention (DESIGN section 3), written for clarity.

Everything is in global prompt order: q (1, L, Hq, D), k/v (1, L, Hkv, D), L = N + Q. The
selection scores are computed in fp32 like the op (the ranking must match exactly); the
attention itself is computed in fp64 so that the oracle's own rounding is negligible.
"""

from __future__ import annotations

import torch

from apbv.plan import Plan


def selected_positions(
    k: torch.Tensor, qbar: torch.Tensor, start: int, end: int, count: int, head: int
) -> list[int]:
    """Global positions of the ``count`` best tokens of block [start, end) for one KV head."""
    raw = [float(k[0, j, head].float() @ qbar[head]) for j in range(start, end)]
    pooled = [max(raw[max(0, i - 2) : i + 3]) for i in range(len(raw))]
    ranked = sorted(range(len(raw)), key=lambda i: (-pooled[i], -raw[i], i))
    return [start + i for i in ranked[:count]]


def visible_keys(q: torch.Tensor, k: torch.Tensor, plan: Plan) -> torch.Tensor:
    """(Hkv, L, L) bool: visible[h, i, j] is True when token i may attend to token j."""
    n, length = plan.context_len, plan.total_len
    hq, hkv = q.shape[2], k.shape[2]
    group = hq // hkv
    query = q[0, n:].float()  # (Q, Hq, D)
    qbar = torch.stack([query[:, h * group : (h + 1) * group].mean(dim=(0, 1)) for h in range(hkv)])
    visible = torch.zeros(hkv, length, length, dtype=torch.bool)
    a = plan.anchor_len
    for i in range(a):
        visible[:, i, : i + 1] = True
    for block, (start, end) in enumerate(plan.blocks):
        for h in range(hkv):
            passed = []
            for earlier in range(block):
                s, e = plan.blocks[earlier]
                passed += selected_positions(k, qbar, s, e, plan.selected_len(earlier), h)
            for i in range(start, end):
                visible[h, i, :a] = True
                visible[h, i, start : i + 1] = True
                visible[h, i, passed] = True
    for i in range(n, length):
        visible[:, i, : i + 1] = True
    return visible


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dense attention in fp64 under a per-KV-head mask (Hkv, L, L); returns (1, L, Hq, D) fp64."""
    group = q.shape[2] // k.shape[2]
    kd = k[0].double().repeat_interleave(group, dim=1)
    vd = v[0].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q[0].double(), kd) * scale
    scores = scores.masked_fill(~visible.repeat_interleave(group, dim=0), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vd).unsqueeze(0)


def oracle_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, scale: float | None = None
) -> torch.Tensor:
    """The APB-V result for global q/k/v under ``plan``; (1, L, Hq, D) fp64."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return masked_attention(q, k, v, visible_keys(q, k, plan), scale)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Ordinary causal attention in fp64; (1, L, Hq, D)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    length = q.shape[1]
    visible = torch.ones(length, length, dtype=torch.bool).tril().expand(k.shape[2], -1, -1)
    return masked_attention(q, k, v, visible, scale)
