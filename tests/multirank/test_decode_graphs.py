"""``decode.graphs``: the switch's resolution, and the static decode step a CUDA graph captures.

The capture itself needs a GPU; here the same static step (the owner's KV written in place at
a device row index, attention over the whole preallocated buffers masked to the valid rows)
runs uncaptured on 1 and 2 gloo ranks of the tiny model through the graph driver: the first
step eager, then the static step checked against it, then replayed per token. Its tokens equal
the eager decode's (one-shot spava and exact, a stream's ask), the cache holds the right rows
afterwards, and a first step that disagrees, or a capture that fails on one rank, falls
back to eager on every rank with a warning.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from apbv.attention import kernels
from apbv.config import RuntimeConfig, load_config
from apbv.distributed import DistInfo, spawn_local
from apbv.engine import decode_graph
from apbv.engine.decode import DecodeContext
from apbv.engine.decode_graph import GraphStep, GraphSteps, resolve_graphs
from apbv.engine.engine import Engine
from apbv.engine.kvcache import RankKVCache
from apbv.engine.request import Request, StreamRef
from apbv.engine.stream_plan import StreamSpec

QUESTION = "Which colour comes after the blue one?"
NEW_TOKENS = 8
SIZE, FPS = 56, 2.0
CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.mark.parametrize("setting, device, backend, world, used", [
    ("auto", CPU, "gloo", 2, False), ("auto", CPU, None, 1, False),
    ("auto", CUDA, "nccl", 8, True), ("auto", CUDA, "gloo", 2, False),
    ("auto", CUDA, "gloo", 1, True), ("auto", CUDA, None, 1, True),
    ("on", CUDA, "nccl", 2, True), ("off", CUDA, "nccl", 8, False), ("off", CPU, None, 1, False)])
def test_resolution(setting: str, device: torch.device, backend: str | None, world: int,
                    used: bool) -> None:
    on, why = resolve_graphs(setting, device, backend, world)
    assert on is used and why, (on, why)
    if device.type == "cpu" and setting == "auto":
        assert "cpu" in why
    if backend == "gloo" and world > 1 and device.type == "cuda":
        assert "gloo collectives cannot be captured" in why


@pytest.mark.parametrize("device, backend, world, reason", [
    (CPU, None, 1, "run on cpu"), (CUDA, "gloo", 2, "gloo collectives cannot be captured")])
def test_on_is_refused_where_capture_cannot_work(device: torch.device, backend: str | None,
                                                 world: int, reason: str) -> None:
    with pytest.raises(ValueError, match=f"decode.graphs=on needs CUDA ranks.*{reason}"):
        resolve_graphs("on", device, backend, world)


def test_bad_values_are_refused(tiny_config: RuntimeConfig) -> None:
    for bad in ("yes", "true", "", "ON"):
        with pytest.raises(ValueError, match="decode.graphs must be one of auto, on, off"):
            resolve_graphs(bad, CPU, None, 1)
        with pytest.raises(ValueError, match="decode.graphs must be one of auto, on, off"):
            load_config("tiny_cpu", [f"decode.graphs={bad!r}"])
    assert load_config("qwen2_5_vl_7b_8gpu").decode.graphs == "auto"
    for name, bad, low in (("graphs_min_tokens", 0, 1), ("graphs_kept", -1, 0)):
        with pytest.raises(ValueError, match=f"decode.{name} must be an integer >= {low}"):
            load_config("tiny_cpu", [f"decode.{name}={bad}"])
    cfg = load_config("tiny_cpu", [f"model.path={str(tiny_config.model.path)!r}",
                                   "decode.graphs=on"])
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=CPU, backend=None)
    with pytest.raises(ValueError, match="decode.graphs=on needs CUDA ranks"):
        Engine(cfg, info)  # refused before the model is loaded


def test_attention_upto_equals_attention_over_the_valid_rows() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 6, 8, generator=g)
    k, v = torch.randn(1, 12, 2, 8, generator=g), torch.randn(1, 12, 2, 8, generator=g)
    for valid in (1, 7, 12):
        want = kernels.attention(q, k[:, :valid], v[:, :valid], causal=True, scale=0.3,
                                 backend="reference")
        got = kernels.attention_upto(q, k, v, torch.tensor([valid]), 0.3)
        for w, x in zip(want, got, strict=True):
            torch.testing.assert_close(x, w, rtol=1e-6, atol=1e-6)


def _graphs_job(info: DistInfo, cfg: RuntimeConfig, video: str) -> dict:
    cfg = dataclasses.replace(cfg, decode=dataclasses.replace(cfg.decode, graphs_min_tokens=1))
    engine = Engine(cfg, info)
    assert not engine.decode_graphs and "cpu" in engine.decode_graphs_why
    frames = torch.randint(0, 256, (4, 3, SIZE, SIZE), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    engine.open_stream("s", StreamSpec(height=SIZE, width=SIZE, fps=FPS))
    engine.append("s", frames, [i / FPS for i in range(4)])
    stream = engine.streams["s"]
    runs = {"n": 0}
    replay = GraphStep.replay

    def counted(self, *args, **kwargs):
        runs["n"] += 1
        return replay(self, *args, **kwargs)

    def answers() -> dict:
        out = {}
        for mode in ("spava", "exact"):
            out[mode] = engine.generate(engine.request(video, QUESTION, mode=mode,
                                                       max_new_tokens=NEW_TOKENS)).token_ids
        mark = stream.cache.lengths()
        out["stream"] = engine.generate(Request(video=StreamRef("s"), question=QUESTION,
                                                mode="exact",
                                                max_new_tokens=NEW_TOKENS)).token_ids
        assert stream.cache.lengths() == mark
        return out

    eager = answers()
    GraphStep.replay = counted
    try:
        engine.decode_graphs = True  # the static step, uncaptured on the CPU
        graphed = answers()
        graph_runs = runs["n"]
        tolerance = dict(decode_graph.TOLERANCE)
        decode_graph.TOLERANCE[torch.float32] = -1.0  # no graph can agree
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            refused = answers()
        decode_graph.TOLERANCE.update(tolerance)
        capture = GraphStep.capture
        if info.rank == info.world_size - 1:  # the last rank cannot capture
            GraphStep.capture = lambda self: "the capture failed: boom"
        before = runs["n"]
        with warnings.catch_warnings(record=True) as uncaptured:
            warnings.simplefilter("always")
            failed = answers()
        GraphStep.capture = capture
    finally:
        GraphStep.replay = replay
    return {"eager": eager, "graphed": graphed, "refused": refused, "graph_runs": graph_runs,
            "refused_runs": before - graph_runs, "failed": failed,
            "failed_runs": runs["n"] - before,
            "warnings": [str(w.message) for w in caught],
            "uncaptured": [str(w.message) for w in uncaptured]}


@pytest.mark.parametrize("world_size", [1, 2])
def test_static_step_tokens_equal_eager(world_size: int, tiny_config: RuntimeConfig,
                                        short_video: Path) -> None:
    per_rank = spawn_local(_graphs_job, world_size, (tiny_config, str(short_video)),
                           timeout_s=600, collective_timeout_s=120)
    for rank, r in enumerate(per_rank):
        assert r["eager"] == per_rank[0]["eager"], rank
        assert r["graphed"] == r["eager"], (rank, r)
        assert r["refused"] == r["eager"], (rank, r)
        steps = sum(len(t) - 1 for t in r["eager"].values())
        assert steps >= 6, r  # each answer has decode steps to replay
        # Every step after the first of each answer replays; the first tries once.
        assert r["graph_runs"] == steps, (r["graph_runs"], steps)
        answers = sum(len(t) > 1 for t in r["eager"].values())
        assert r["refused_runs"] == answers, r  # one try each, then eager
        assert len(r["warnings"]) == answers and all(
            "decode.graphs: the captured decode step is not used" in w and "max |graph - eager|"
            in w for w in r["warnings"]), r["warnings"]
        # A rank whose capture fails: every rank decodes eagerly, nothing replayed.
        assert r["failed"] == r["eager"] and r["failed_runs"] == 0, (rank, r)
        why = "boom" if rank == world_size - 1 else "another rank's capture failed"
        assert len(r["uncaptured"]) == answers and all(why in w for w in r["uncaptured"]), (
            rank, r["uncaptured"])


@pytest.mark.parametrize("rows, want", [(1, 64), (64, 64), (65, 80), (1000, 1024),
                                        (1025, 1280), (1100, 1280), (70000, 81920)])
def test_buckets_round_up_by_at_most_a_quarter(rows: int, want: int) -> None:
    got = decode_graph.bucket(rows)
    assert got == want and rows <= got <= max(64, 1.25 * rows), (rows, got)


def test_rehouse_moves_the_rows_into_the_given_buffers() -> None:
    cache = RankKVCache(2, reserve=3)
    k, v = torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2, 4)
    for layer in range(2):
        cache.store(layer, k, v)
    houses = {layer: (torch.full((1, 16, 2, 4), 7.0), torch.full((1, 16, 2, 4), 7.0))
              for layer in range(2)}
    cache.rehouse(lambda layer, like: houses[layer])
    for layer in range(2):
        keys, values = cache.buffers(layer)
        assert keys is houses[layer][0] and values is houses[layer][1]
        torch.testing.assert_close(cache.layer(layer)[0], k, rtol=0, atol=0)
        torch.testing.assert_close(cache.layer(layer)[1], v, rtol=0, atol=0)
        assert bool((keys[:, 5:] == 7.0).all()), "rows past the cached ones were touched"
    assert cache.num_tokens() == 5 and cache.room() == 11, (cache.num_tokens(), cache.room())


def test_make_room_drops_the_least_recently_used_kept_steps() -> None:
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=CPU, backend=None)
    steps = GraphSteps(4, 16, CPU)
    like = torch.zeros(1, 1, 2, 8)  # 2 KV heads x 8 dims of fp32: 64 bytes a row
    for capacity in (64, 80, 96):
        step = GraphStep(None, DecodeContext(info, RankKVCache(2), None), CPU,
                         capacity=capacity)
        for layer in range(2):
            step.house(layer, like)
        steps.steps[(capacity, 1)] = step
    steps.steps.move_to_end((64, 1))  # the 64-row step was used last
    row = 2 * 2 * 64  # keys and values of 2 layers
    assert steps.make_room(0) == 0 and len(steps.steps) == 3
    assert steps.make_room(1) == 80 * row and list(steps.steps) == [(96, 1), (64, 1)]
    assert steps.make_room(96 * row + 1) == (96 + 64) * row and not steps.steps
    assert steps.make_room(1) == 0


def _kept_bytes(steps: GraphSteps) -> int:
    return sum(t.numel() * t.element_size() for step in steps.steps.values()
               for kv in step.kv.values() for t in kv)


@pytest.mark.parametrize("need, dropped", [(500, 0), (1500, 1), (3500, 2)])
def test_a_request_short_of_cuda_memory_drops_kept_steps_first(
        monkeypatch: pytest.MonkeyPatch, tiny_config: RuntimeConfig, need: int,
        dropped: int) -> None:
    """The memory check on a CUDA rank (faked: the free memory 500 bytes, the cached blocks
    the allocator's reserve less what the kept steps hold): kept steps are dropped, least
    recently used first, only as far as the request needs their room."""
    engine = Engine.__new__(Engine)  # the check alone: no model
    engine.cfg = tiny_config
    engine.info = DistInfo(rank=0, world_size=1, local_rank=0, device=CUDA, backend=None)
    steps = engine.graph_steps = GraphSteps(4, 16, CPU)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=CPU, backend=None)
    for capacity in (1, 2):  # 1024 and 2048 bytes of fp32 KV
        step = GraphStep(None, DecodeContext(info, RankKVCache(1), None), CPU,
                         capacity=capacity * 64)
        step.house(0, torch.zeros(1, 1, 1, 2))
        steps.steps[(capacity * 64, 1)] = step
    reserved = _kept_bytes(steps)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (500, 10**9))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: _kept_bytes(steps))
    estimate = SimpleNamespace(parts={"weights": 100}, device_total=need + 100)
    got, budget, source = engine._memory_need_and_budget(estimate)  # type: ignore[arg-type]
    assert got == need and "free memory of cuda:0" in source, (got, source)
    assert len(steps.steps) == 2 - dropped, (need, list(steps.steps))
    assert budget == 500 + reserved - _kept_bytes(steps), (budget, reserved)
    assert dropped == 0 or budget >= need or not steps.steps, (need, budget)


def _kept_job(info: DistInfo, cfg: RuntimeConfig, video: str) -> dict:
    cfg = dataclasses.replace(cfg, decode=dataclasses.replace(
        cfg.decode, graphs_min_tokens=NEW_TOKENS, graphs_kept=4))
    engine = Engine(cfg, info)
    questions = [QUESTION, "What colour is the first frame?"]

    def answers(new_tokens: int = NEW_TOKENS, ask: list[str] = questions) -> list[list[int]]:
        return [engine.generate(engine.request(video, q, mode="spava",
                                               max_new_tokens=new_tokens)).token_ids
                for q in ask]

    eager = answers()
    served, replays = [], {"n": 0}
    step, replay = GraphSteps.step, GraphStep.replay

    def recorded(self, model, ctx, max_new_tokens):
        got = step(self, model, ctx, max_new_tokens)
        served.append((id(got), [ctx.cache.buffers(layer)[0].data_ptr()
                                 for layer in range(model.num_layers)],
                       [got.kv[layer][0].data_ptr() for layer in range(model.num_layers)]))
        return got

    def counted(self):
        replays["n"] += 1
        return replay(self)

    GraphSteps.step, GraphStep.replay = recorded, counted
    try:
        engine.decode_graphs = True  # the static step, uncaptured on the CPU
        graphed = answers()
        steps = engine.graph_steps
        assert steps is not None
        counts = {"made": steps.made, "reused": steps.reused, "kept": len(steps.steps),
                  "replays": replays["n"]}
        short = answers(NEW_TOKENS - 1, questions[:1])  # below graphs_min_tokens: eager
        short_counts = {"made": steps.made, "reused": steps.reused, "replays": replays["n"]}
    finally:
        GraphSteps.step, GraphStep.replay = step, replay
    return {"eager": eager, "graphed": graphed, "short": short,
            "served": served, "counts": counts, "short_counts": short_counts}


def test_steps_are_kept_across_requests(tiny_config: RuntimeConfig,
                                        short_video: Path) -> None:
    per_rank = spawn_local(_kept_job, 2, (tiny_config, str(short_video)), timeout_s=600,
                           collective_timeout_s=120)
    for rank, r in enumerate(per_rank):
        assert r["graphed"] == r["eager"] == per_rank[0]["eager"], (rank, r)
        assert r["short"][0] == r["eager"][0][:NEW_TOKENS - 1], (rank, r)  # greedy: a prefix
        steps = sum(len(t) - 1 for t in r["eager"])
        assert steps >= 4 and all(len(t) > 1 for t in r["eager"]), r["eager"]
        # The second request of the bucket is served by the first one's step: the same
        # object, its KV buffers those the cache decoded in, on every layer.
        (first, cache1, own1), (second, cache2, own2) = r["served"]
        assert second == first and cache2 == cache1 == own1 == own2, (rank, r["served"])
        assert r["counts"] == {"made": 1, "reused": 1, "kept": 1, "replays": steps}, (
            rank, r["counts"], steps)
        # Answers allowed fewer than decode.graphs_min_tokens: no step made or replayed.
        assert r["short_counts"] == {k: r["counts"][k] for k in ("made", "reused", "replays")}, (
            rank, r["short_counts"])
