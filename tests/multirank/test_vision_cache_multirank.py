"""Vision reuse on 2 gloo ranks: a second question about the same video skips decoding and the
vision tower on every rank and gives the tokens of an engine without the cache; a rank that
lost its entry while the other kept it still answers (the collectives run either way); a
rewritten file is a miss."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections import Counter
from pathlib import Path

from apbv import comm
from apbv.config import RuntimeConfig
from apbv.distributed import DistInfo, spawn_local

Q1, Q2 = "What is shown?", "Which colour comes last?"


def _count_calls(engine, counts: Counter) -> None:
    import apbv.engine.engine as engine_module

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    engine.model.vision_tower = counted("vision_tower", engine.model.vision_tower)
    engine.model.process_frames = counted("process_frames", engine.model.process_frames)
    engine_module.load_rank_frames = counted("load_rank_frames", engine_module.load_rank_frames)


def _ask_twice(info: DistInfo, cfg: RuntimeConfig, video: str) -> dict:
    from apbv.engine.engine import Engine

    counts: Counter = Counter()
    cached = Engine(dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, vision_gb=1.0)),
                    info)
    _count_calls(cached, counts)

    def ask(engine, question):
        result = engine.generate(engine.request(video, question, max_new_tokens=4))
        return result, dict(counts)

    out = {"first": ask(cached, Q1), "second": ask(cached, Q2)}
    out["entries"] = (len(cached.vision_cache), cached.vision_cache.nbytes)
    if info.rank == 1:  # this rank lost its entry, rank 0 keeps its own
        cached.vision_cache.clear()
    out["one_rank_hit"] = ask(cached, Q1)
    if info.rank == 0:  # the file is rewritten: a new mtime
        st = os.stat(video)
        os.utime(video, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    comm.barrier(info.group)
    out["rewritten"] = ask(cached, Q1)
    out["entries_after"] = len(cached.vision_cache)
    plain = Engine(cfg, info)
    out["uncached"] = plain.generate(plain.request(video, Q2, max_new_tokens=4))
    return out


def test_second_question_reuses_the_vision_embeddings(
    tiny_config: RuntimeConfig, short_video: Path, tmp_path: Path
) -> None:
    video = tmp_path / "clip.mp4"
    shutil.copyfile(short_video, video)
    per_rank = spawn_local(_ask_twice, 2, (tiny_config, str(video)), timeout_s=300,
                           collective_timeout_s=60)
    for rank, out in enumerate(per_rank):
        first, after_first = out["first"]
        second, after_second = out["second"]
        assert not first.vision_cache_hit and second.vision_cache_hit, rank
        calls = {"vision_tower": 1, "process_frames": 1, "load_rank_frames": 1}
        assert after_first == calls and after_second == calls, (rank, after_second)
        rows, nbytes = out["entries"]
        assert rows == 1 and 0 < nbytes < 2**30, out["entries"]
        # The cached engine's answer to the second question is the uncached engine's.
        uncached = out["uncached"]
        assert not uncached.vision_cache_hit
        assert second.token_ids == uncached.token_ids and len(second.token_ids) >= 1
        assert second.first_logits.equal(uncached.first_logits)
        assert second.frames == uncached.frames and second.context_len == uncached.context_len
        # Rank 1 missed, rank 0 hit: not a hit overall, the same tokens as the first time.
        mixed, after_mixed = out["one_rank_hit"]
        assert not mixed.vision_cache_hit and mixed.token_ids == first.token_ids
        assert after_mixed["vision_tower"] == (1 if rank == 0 else 2), (rank, after_mixed)
        # A rewritten file (new mtime) is a miss on every rank; its old entry is dropped.
        rewritten, after_rewritten = out["rewritten"]
        assert not rewritten.vision_cache_hit and rewritten.token_ids == first.token_ids
        assert after_rewritten["load_rank_frames"] == after_mixed["load_rank_frames"] + 1
        assert out["entries_after"] == 1
    assert per_rank[0]["second"][0].to_json() == per_rank[1]["second"][0].to_json()
