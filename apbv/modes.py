"""The runtime's modes, one flag apart: the same sampler, pipeline and timer for every one.

Each mode is a plan (layout, anchor, passing budget) plus two switches; the attention semantics
are always those of :mod:`apbv.attention.spava` under that plan (a context token sees the
anchor, the selections of the blocks before its own, and its own block causally; query tokens
are exact), so each mode's single-process oracle is the dense-mask oracle under its plan.

=============  ==========  ============  =============  =====================================
mode           layout      anchor        passing P      what it is
=============  ==========  ============  =============  =====================================
spava          zigzag      ~N/64         ~N/128         APB-V, the method
exact          zigzag      ~N/64         infinite       spava passing everything: = causal
no_overlap     zigzag      ~N/64         ~N/128         spava, every collective waited at once
no_vit_split   zigzag      ~N/64         ~N/128         spava, every rank encodes the whole video
zigzag_ring    zigzag      none          infinite       exact sequence parallelism, ZigZag
                                                        balance (KV all-gathered, not a ring)
star           star        first N/H     0              Star Attention: anchor + own block,
                                                        exact query phase
apb            contiguous  ~N/64         ~2N/128        APB without ZigZag: H blocks, budget 2P,
                                                        query-aware selection (not trained heads)
full           -           -             -              one process, plain causal attention
=============  ==========  ============  =============  =====================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from apbv.plan import Plan, default_passing_len, make_plan


@dataclass(frozen=True)
class Mode:
    name: str
    layout: str = "zigzag"
    anchor: str = "default"
    """default (about N/64), none, or star (Star's first block, ceil(N/H))."""
    passing: str = "default"
    """default (about N/128), infinite, zero, or double."""
    overlap: bool = True
    """False: wait on every collective right after starting it (the op's ``overlap``)."""
    vit_split: bool = True
    """False: every rank runs the vision tower on the whole video."""
    single_process: bool = False
    """True: world size 1, one causal attention call per layer."""

    def plan(
        self,
        context_len: int,
        query_len: int,
        world_size: int,
        *,
        anchor_len: int | None = None,
        passing_len: int | None = None,
    ) -> Plan:
        """The plan of this mode; explicit anchor/passing lengths replace the mode's defaults
        where the mode has a budget to set (not for exact, zigzag_ring, star and full)."""
        if self.single_process and world_size != 1:
            raise ValueError(f"mode {self.name!r} is the single-process baseline: run it on one "
                             f"rank, not {world_size}")
        if self.anchor == "none":
            anchor_len = 0
        elif self.anchor == "star":
            anchor_len = math.ceil(context_len / world_size)
        if self.passing == "zero":
            passing_len = 0
        elif self.passing == "double" and passing_len is None:
            passing_len = 2 * default_passing_len(context_len)
        plan = make_plan(context_len, query_len, world_size, anchor_len=anchor_len,
                         passing_len=passing_len, layout=self.layout)
        return plan.exact() if self.passing == "infinite" or self.single_process else plan


MODES: dict[str, Mode] = {  # apbv.MODES: the one mode vocabulary of the runtime and the op
    m.name: m
    for m in (
        Mode("spava"),
        Mode("exact", passing="infinite"),
        Mode("no_overlap", overlap=False),
        Mode("no_vit_split", vit_split=False),
        Mode("zigzag_ring", anchor="none", passing="infinite"),
        Mode("star", layout="star", anchor="star", passing="zero"),
        Mode("apb", layout="contiguous", passing="double"),
        Mode("full", single_process=True),
    )
}
MODE_NAMES = tuple(MODES)


def get_mode(name: str) -> Mode:
    if name not in MODES:
        raise ValueError(f"unknown mode {name!r}; allowed: {', '.join(MODE_NAMES)}")
    return MODES[name]
