"""The distributed APB-V op on H gloo ranks against the single-process dense-mask oracle.

One spawn per world size runs every case (a spawn costs seconds); the parent puts the shards
back in global order and checks each case, reporting all failures at once.
"""

from __future__ import annotations

import pytest
import torch

from apbv import apbv_attention
from apbv.distributed import DistInfo, spawn_local
from apbv.layout import shard, unshard
from tests.cases import CASES, Case, check


def _run_cases(info: DistInfo, cases: list[Case]) -> list[torch.Tensor]:
    outs = []
    for case in cases:
        if not case.runs_on(info.world_size):
            outs.append(None)
            continue
        plan = case.plan(info.world_size)
        q, k, v = (shard(t, plan, info.rank) for t in case.inputs())
        outs.append(apbv_attention(q, k, v, plan, overlap=case.overlap))
    return outs


@pytest.mark.parametrize("world_size", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_distributed_matches_oracle(world_size: int) -> None:
    per_rank = spawn_local(_run_cases, world_size, (CASES,), timeout_s=300,
                           collective_timeout_s=60)
    problems = []
    for i, case in enumerate(CASES):
        if not case.runs_on(world_size):
            continue
        plan = case.plan(world_size)
        out = unshard([outs[i] for outs in per_rank], plan)
        problem = check(case, plan, out)
        if problem:
            problems.append(problem)
    assert not problems, "\n".join(problems)
