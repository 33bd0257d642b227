"""Collectives of greedy decode: a step's are its layers' all-gathers, and nothing else.

Every rank merges the same gathered partials, so every rank picks the same token itself; the
query rank's stop flag and each rank's fed token ride along the first layer's all-gather. On
2 gloo ranks of the tiny model, every collective of :mod:`apbv.comm` is counted (nested calls
once) while decode runs:

- a plain request and one the query rank cancels: exactly L all-gathers per step, none
  between steps; the cancelled one ends on every rank at the same step, with the plain
  answer's first tokens and ``cancelled``;
- ranks that feed different tokens (rank 1's first token shifted) fail on every rank at the
  first step instead of decoding on.

The plain request's collectives, counted per stage and outside the stages, are the ones the
cost model prices (:mod:`apbv.cost.control` and the stages' data collectives), so a new
collective in the engine shows here until the model counts it too.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from apbv import comm, timing
from apbv.config import RuntimeConfig
from apbv.cost import control
from apbv.distributed import DistInfo, spawn_local
from apbv.engine import decode, runner
from apbv.engine.engine import Engine
from apbv.modes import get_mode

QUESTION = "Which colour comes after the blue one?"
NEW_TOKENS = 6
COLLECTIVES = ("start_all_gather", "all_gather", "all_to_all_rows", "broadcast",
               "broadcast_object", "any_rank", "barrier", "all_reduce_max",
               "all_gather_ints", "all_gather_object", "first_failure")


def _counting_job(info: DistInfo, cfg: RuntimeConfig, video: str) -> dict:
    engine = Engine(cfg, info)
    state: dict[str, Any] = {"decode": False, "step": False, "depth": 0, "steps": 0,
                             "stage": "outside"}
    counts: Counter = Counter()
    by_stage: Counter = Counter()
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, wrap: Any) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrap(getattr(owner, name)))

    def counted(name: str) -> Any:
        def wrap(original: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                if state["decode"] and state["depth"] == 0:
                    counts["in step" if state["step"] else "between steps", name] += 1
                if state["depth"] == 0:
                    by_stage[state["stage"], name] += 1
                state["depth"] += 1
                try:
                    return original(*args, **kwargs)
                finally:
                    state["depth"] -= 1
            return call
        return wrap

    def flag(key: str, count: bool = False) -> Any:
        def wrap(original: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                state[key] = True
                state["steps"] += count
                try:
                    return original(*args, **kwargs)
                finally:
                    state[key] = False
            return call
        return wrap

    def staged(original: Any) -> Any:
        def stage(timer: Any, name: str) -> Any:
            inner = original(timer, name)

            class Staged:
                def __enter__(self) -> None:
                    state["stage"] = name
                    inner.__enter__()

                def __exit__(self, *exc: Any) -> Any:
                    try:
                        return inner.__exit__(*exc)  # the stage's barrier is the stage's
                    finally:
                        state["stage"] = "outside"
            return Staged()
        return stage

    for name in COLLECTIVES:
        patch(comm, name, counted(name))
    patch(timing.StageTimer, "stage", staged)
    patch(runner, "greedy_continue", flag("decode"))
    patch(decode, "decode_step", flag("step", count=True))
    seen: list[int] = []
    results = {}
    try:
        for kind in ("plain", "cancelled"):
            counts.clear()
            by_stage.clear()
            state["steps"] = 0
            seen.clear()
            stop = (lambda: len(seen) >= 3) if kind == "cancelled" and info.rank == 0 else None
            result = engine.generate(engine.request(video, QUESTION, mode="exact",
                                                    max_new_tokens=NEW_TOKENS),
                                     on_token=seen.append, stop=stop)
            results[kind] = {"tokens": result.token_ids, "finish": result.finish_reason,
                             "steps": state["steps"], "counts": dict(counts),
                             "by_stage": dict(by_stage), "stages": len(result.seconds),
                             "plan": (result.context_len, result.query_len)}
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
    return {"layers": engine.model.num_layers, **results}


def test_a_decode_step_has_one_collective_per_layer(tiny_config: RuntimeConfig,
                                                     short_video: Path) -> None:
    per_rank = spawn_local(_counting_job, 2, (tiny_config, str(short_video)), timeout_s=300,
                           collective_timeout_s=120)
    for rank, r in enumerate(per_rank):
        for kind in ("plain", "cancelled"):
            run = r[kind]
            assert run["tokens"] == per_rank[0][kind]["tokens"], (rank, kind)
            assert run["steps"] >= 2, (rank, kind, run)  # the check needs decode steps
            counts = Counter({tuple(k): n for k, n in run["counts"].items()})
            between = {k: n for k, n in counts.items() if k[0] == "between steps"}
            assert not between, f"rank {rank} {kind}: collectives between steps: {between}"
            assert counts == Counter({("in step", "all_gather"): r["layers"] * run["steps"]}), (
                f"rank {rank} {kind}: {run['steps']} steps of {r['layers']} layers: {counts}")
        plain, cancelled = r["plain"], r["cancelled"]
        assert plain["finish"] in ("stop", "length") and len(plain["tokens"]) > 3, plain
        assert (cancelled["tokens"], cancelled["finish"]) == (plain["tokens"][:3],
                                                               "cancelled"), (rank, cancelled)
        assert cancelled["steps"] == 3, cancelled  # the third step's token is not used
        # every collective of the plain request, where the cost model prices it
        plan = get_mode("exact").plan(*plain["plan"], 2)
        layers = r["layers"]
        expected = Counter({("outside", "all_gather_ints"): control.REQUEST_CHECKS,
                            ("outside", "all_reduce_max"): plain["stages"]
                            + control.RESULT_REDUCES,
                            ("preprocess", "first_failure"): control.PREPROCESS_CHECKS,
                            ("vision", "first_failure"): 1, ("vision", "any_rank"): 1,
                            ("transfer", "all_to_all_rows"): 1,
                            ("prefill", "start_all_gather"): layers
                            * (plan.blocks_per_rank + 1),
                            ("first_token", "broadcast"): 1,
                            ("decode", "all_gather"): layers * plain["steps"]})
        assert control.VISION_CHECKS == 2 and plain["stages"] == 6, plain["stages"]
        assert control.bookkeeping_collectives(plain["stages"]) == 8
        expected.update({(stage, "barrier"): 1 for stage in timing.STAGES})
        got = Counter({tuple(k): n for k, n in plain["by_stage"].items()})
        assert got == expected, (f"rank {rank}: the request's collectives differ from the "
                                 f"cost model's: got {got - expected}, "
                                 f"missing {expected - got}")


def _diverging_job(info: DistInfo, cfg: RuntimeConfig, video: str) -> str:
    engine = Engine(cfg, info)
    pick = runner.pick_token

    def shifted(logits: torch.Tensor, group: Any, *sampling: Any) -> torch.Tensor:
        token = pick(logits, group, *sampling)
        return token + 1 if info.rank == 1 else token

    runner.pick_token = shifted
    try:
        engine.generate(engine.request(video, QUESTION, mode="exact",
                                       max_new_tokens=NEW_TOKENS))
    except RuntimeError as exc:
        return str(exc)
    finally:
        runner.pick_token = pick
    return "no error"


def test_ranks_feeding_different_tokens_fail_together(tiny_config: RuntimeConfig,
                                                      short_video: Path) -> None:
    messages = spawn_local(_diverging_job, 2, (tiny_config, str(short_video)), timeout_s=300,
                           collective_timeout_s=120)
    for rank, message in enumerate(messages):
        assert "fed different tokens to decode step 1" in message, (rank, message)


@pytest.mark.parametrize("fed, stop, expected", [
    ([7, 7], [0, 0], 3), ([7, 7], [1, 0], decode.STOP), ([7, 9], [0, 0], decode.DIVERGED),
    ([7, 9], [1, 0], decode.DIVERGED), ([7, 7], [0, 1], 3)])
def test_step_token(fed: list[int], stop: list[int], expected: int) -> None:
    """Only the query rank's (rank 0's) stop flag counts; disagreement wins over a stop."""
    logits = torch.zeros(10)
    logits[3] = 1.0
    received = torch.tensor([stop, fed], dtype=torch.float32).T
    assert decode.step_token(logits, received).tolist() == [expected]
