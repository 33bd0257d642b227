"""Decode appends its KV into buffers allocated before it starts: none is reallocated while it
runs, for a one-shot request (the prefill's reservation of ``max_new_tokens`` rows) and for a
live stream's question (:meth:`RankKVCache.make_room` before the question's rows), on 1 and 2
gloo ranks of the tiny model. Each rank records where every layer's cached keys and values
live when decode starts and when it ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from apbv.config import RuntimeConfig
from apbv.distributed import DistInfo, spawn_local
from apbv.engine import runner
from apbv.engine.engine import Engine
from apbv.engine.kvcache import RankKVCache
from apbv.engine.request import Request, StreamRef
from apbv.engine.stream_plan import StreamSpec

QUESTION = "Which colour comes after the blue one?"
NEW_TOKENS = 24  # more than a stream's geometric growth leaves free after a short question
SIZE, FPS = 56, 2.0


def _where(cache: RankKVCache) -> list[tuple[int, int]]:
    """Per stored layer, the addresses of the cached keys and values (their buffers' starts)."""
    return [_where_of(cache, layer) for layer in range(len(cache.lengths()))
            if cache.holds(layer)]


def _buffers_job(info: DistInfo, cfg: RuntimeConfig, video: str) -> dict:
    engine = Engine(cfg, info)
    greedy = runner.greedy_continue
    seen: list[dict[str, Any]] = []

    def recording(model, first_token, first_id, next_position, cache, *args, **kwargs):
        before = _where(cache)
        answer = greedy(model, first_token, first_id, next_position, cache, *args, **kwargs)
        seen.append({"moved": _where(cache) != before, "steps": len(answer.tokens) - 1})
        return answer

    runner.greedy_continue = recording
    try:
        engine.generate(engine.request(video, QUESTION, mode="exact",
                                       max_new_tokens=NEW_TOKENS))
        frames = torch.randint(0, 256, (2, 3, SIZE, SIZE), dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(0))
        engine.open_stream("s", StreamSpec(height=SIZE, width=SIZE, fps=FPS))
        engine.append("s", frames, [0.0, 1 / FPS])
        engine.generate(Request(video=StreamRef("s"), question=QUESTION, mode="exact",
                                max_new_tokens=NEW_TOKENS))
    finally:
        runner.greedy_continue = greedy
    return {"one_shot": seen[0], "stream": seen[1]}


@pytest.mark.parametrize("world_size", [1, 2])
def test_decode_reallocates_no_kv_buffer(world_size: int, tiny_config: RuntimeConfig,
                                         short_video: Path) -> None:
    per_rank = spawn_local(_buffers_job, world_size, (tiny_config, str(short_video)),
                           timeout_s=300, collective_timeout_s=120)
    for rank, r in enumerate(per_rank):
        for kind in ("one_shot", "stream"):
            assert r[kind]["steps"] >= 16, (rank, kind, r)  # past the old growth's slack
            assert not r[kind]["moved"], f"rank {rank} {kind}: a KV buffer moved in decode"


def test_make_room_allocates_once() -> None:
    cache = RankKVCache(2)
    k = torch.arange(2 * 3 * 4, dtype=torch.float32).view(1, 3, 2, 4)
    cache.store(0, k, -k)  # layer 1 is not stored: left alone
    cache.make_room(5)
    where = _where_of(cache, 0)
    for i in range(5):
        cache.append(0, k[:, i % 3:i % 3 + 1], -k[:, i % 3:i % 3 + 1])
        assert _where_of(cache, 0) == where, i
    keys, values = cache.layer(0)
    assert keys.shape == (1, 8, 2, 4) and torch.equal(values, -keys)
    assert torch.equal(keys[:, :3], k) and torch.equal(keys[:, 3:], k[:, [0, 1, 2, 0, 1]])
    assert not cache.holds(1) and cache.capacity_bytes() == 2 * 8 * 2 * 4 * 4
    cache.make_room(0)  # room enough: nothing moves
    assert _where_of(cache, 0) == where
    cache.append(0, k, k)  # past it: grows as before
    assert cache.num_tokens(0) == 11 and _where_of(cache, 0) != where


def _where_of(cache: RankKVCache, layer: int) -> tuple[int, int]:
    k, v = cache.layer(layer)
    return k.data_ptr(), v.data_ptr()
