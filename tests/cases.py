"""Shared cases for the APB-V op tests: one op call each, checked against tests/oracle.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from apbv.modes import get_mode
from apbv.plan import Plan
from tests.oracle import causal_attention, masked_attention, oracle_attention, visible_keys

FP32_TOL = 1e-5  # the op vs the fp64 oracle in fp32: rounding of sums over <= 1k keys
# A choice's log-probability (fp32, tens of nats) computed two ways through the whole model:
# relative to its size, since the rounding grows with it. About 170 ulps; the same pairs have
# measured 1e-7 to 3e-6 on different CPUs, a wrong context is off by 1e-2 or more.
LOGPROB_RTOL = 2e-5


def logprob_error(got: float, want: float) -> float:
    """|got - want| relative to max(1, |want|), to compare with LOGPROB_RTOL."""
    return abs(got - want) / max(1.0, abs(want))


@dataclass(frozen=True)
class Case:
    context_len: int
    query_len: int
    anchor_len: int | None = None
    passing_len: int | None = None
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    mode: str = "spava"
    """A mode of apbv.MODES: its plan (with the case's anchor/passing) and its overlap."""
    dtype: str = "float32"
    seed: int = 0

    def plan(self, world_size: int) -> Plan:
        return get_mode(self.mode).plan(self.context_len, self.query_len, world_size,
                                        anchor_len=self.anchor_len, passing_len=self.passing_len)

    @property
    def overlap(self) -> bool:
        return get_mode(self.mode).overlap

    def runs_on(self, world_size: int) -> bool:
        return not get_mode(self.mode).single_process or world_size == 1

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Global q (1, L, Hq, D), k/v (1, L, Hkv, D) in the case's dtype."""
        g = torch.Generator().manual_seed(self.seed)
        length = self.context_len + self.query_len
        dtype = getattr(torch, self.dtype)
        q = torch.randn(1, length, self.heads, self.head_dim, generator=g).to(dtype)
        k = torch.randn(1, length, self.kv_heads, self.head_dim, generator=g).to(dtype)
        v = torch.randn(1, length, self.kv_heads, self.head_dim, generator=g).to(dtype)
        return q, k, v


CASES = [
    Case(200, 7),  # default anchor and passing
    Case(300, 5, anchor_len=10, passing_len=20),
    Case(37, 3, anchor_len=2, passing_len=3, heads=4, kv_heads=4, head_dim=8),
    Case(5, 2, anchor_len=1, passing_len=1),  # empty blocks for H >= 3
    Case(500, 9, anchor_len=0, passing_len=8, heads=8, kv_heads=2, head_dim=32),
    Case(400, 1, anchor_len=16, passing_len=0, heads=6, kv_heads=2),  # nothing passed
    Case(256, 16, passing_len=1000),  # P >= every block: spava is exact
    Case(300, 5, mode="exact"),
    Case(37, 3, anchor_len=2, passing_len=3, heads=8, kv_heads=2, mode="exact"),
    Case(123, 4, anchor_len=0, mode="exact", seed=3),
    Case(300, 5, anchor_len=10, passing_len=20, mode="no_overlap"),
    Case(300, 6, anchor_len=12, passing_len=16, heads=8, kv_heads=2, head_dim=32,
         dtype="bfloat16", seed=1),
    Case(792, 13, heads=12, kv_heads=2, head_dim=128, seed=6),  # InternVL3-2B heads, 3 frames
    Case(233, 11, heads=32, kv_heads=8, head_dim=128, seed=7),  # Qwen3-VL-8B heads
    # The comparison modes, each against the oracle under its own plan.
    Case(300, 5, mode="zigzag_ring"),
    Case(301, 7, mode="star", seed=4),
    Case(33, 2, mode="star", heads=4, kv_heads=4, head_dim=8),
    Case(300, 5, mode="apb", seed=5),
    Case(300, 5, passing_len=7, mode="apb", heads=8, kv_heads=2),
    Case(290, 5, mode="no_vit_split"),
    Case(200, 9, mode="full"),
]


def check(case: Case, plan: Plan, out: torch.Tensor) -> str | None:
    """None if ``out`` (global order) is right for ``case``, else a message with the errors."""
    q, k, v = case.inputs()
    scale = case.head_dim**-0.5
    if plan.is_exact:
        want = causal_attention(q, k, v)
    else:
        want = oracle_attention(q, k, v, plan)
    err = (out.double() - want).abs()
    if case.dtype == "float32":
        tol = FP32_TOL
    else:
        # flash-attention's rule: at most twice the error of a same-dtype dense reference
        # (scores, probabilities and output rounded to the dtype) under the same mask.
        mask = visible_keys(q, k, plan)
        naive = _same_dtype_attention(q, k, v, mask, scale)
        tol = 2 * (naive.double() - want).abs().max().item() + 1e-6
    if err.max().item() <= tol:
        return None
    return (f"{case} on {plan.world_size} rank(s): max err {err.max().item():.2e}, "
            f"mean err {err.mean().item():.2e}, tolerance {tol:.2e}")


def _same_dtype_attention(q, k, v, mask, scale):
    group = q.shape[2] // k.shape[2]
    kr, vr = k[0].repeat_interleave(group, 1), v[0].repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q[0], kr) * scale
    s = s.masked_fill(~mask.repeat_interleave(group, 0), float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.einsum("hqk,khd->qhd", p, vr).unsqueeze(0)


__all__ = ["CASES", "Case", "FP32_TOL", "check", "masked_attention"]
