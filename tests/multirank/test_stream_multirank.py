"""Live streams on the tiny Qwen2.5-VL over 1, 2 and 3 gloo ranks (fp32).

- without eviction, ``ask`` returns the tokens of one-shot ``exact`` mode on the same decoded
  frames, and the closed-vocabulary path the same log-probabilities; asking leaves the stream
  unchanged, and appending goes on after an ask;
- with a window, per-rank KV stays flat within one chunk over twice the window, re-basing
  the positions leaves the answers unchanged, and ``fresh=True`` answers as one-shot spava on
  the held frames;
- frames of the wrong size, or different frames on different ranks, are refused on every rank
  and leave the stream as it was.
"""

from __future__ import annotations

import pytest
import torch

from apbv.config import RuntimeConfig
from apbv.distributed import DistInfo, spawn_local
from apbv.engine.engine import Engine
from apbv.engine.request import Request, StreamRef
from apbv.engine.stream_plan import StreamSpec
from apbv.video import DecodedVideo
from tests.cases import LOGPROB_RTOL, logprob_error

QUESTION = "What colour is the square at the end?"
CHOICES = ("yes", "no", "red square")
FPS = 2.0
SIZE = 56  # 2x2 merged tokens per temporal patch: 4 tokens per chunk of one patch
NEW_TOKENS = 4


def _frames(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, SIZE, SIZE), dtype=torch.uint8, generator=g)


def _one_shot(engine: Engine, frames: torch.Tensor, mode: str, **kw) -> dict:
    result = engine.generate(Request(video=DecodedVideo(frames, FPS), question=QUESTION,
                                     mode=mode, **kw))
    return {"tokens": result.token_ids,
            "choices": None if result.choices is None else [c["logprob"] for c in result.choices]}


def _ask(engine: Engine, stream_id: str, *, fresh: bool = False, **kw):
    """A question about the stream: over its held KV (exact), or fresh (one-shot spava)."""
    return engine.generate(Request(video=StreamRef(stream_id, fresh), question=QUESTION,
                                   mode="spava" if fresh else "exact", **kw))


def _exact_job(info: DistInfo, cfg: RuntimeConfig) -> dict:
    engine = Engine(cfg, info)
    frames = _frames(44)
    stamps = [i / FPS for i in range(len(frames))]
    engine.open_stream("s", StreamSpec(height=SIZE, width=SIZE, fps=FPS))
    # Pushes of 3, 1, 2, 3, 1, ... frames: odd frames wait for their pair.
    cut, sizes, i = 0, [3, 1, 2], 0
    while cut < 40:
        n = sizes[i % 3]
        engine.append("s", frames[cut:cut + n], stamps[cut:cut + n])
        cut, i = cut + n, i + 1
    asked = _ask(engine, "s", max_new_tokens=NEW_TOKENS)
    again = _ask(engine, "s", max_new_tokens=NEW_TOKENS)
    scored = _ask(engine, "s", choices=CHOICES)
    engine.append("s", frames[40:43], stamps[40:43])  # 42 whole frames, one waiting
    later = _ask(engine, "s", max_new_tokens=NEW_TOKENS)
    return {
        "stream": asked.token_ids, "again": again.token_ids, "later": later.token_ids,
        "choices": [c["logprob"] for c in scored.choices],
        "chunks": engine.describe_stream("s").chunks_held,
        "tokens_per_rank": engine.describe_stream("s").tokens_per_rank,
        "header": engine.streams["s"].header_len,
        "one": _one_shot(engine, frames[:40], "exact", max_new_tokens=NEW_TOKENS),
        "one_choices": _one_shot(engine, frames[:40], "exact", choices=CHOICES),
        "one_later": _one_shot(engine, frames[:42], "exact", max_new_tokens=NEW_TOKENS),
    }


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ask_equals_one_shot_exact(world_size: int, tiny_config: RuntimeConfig) -> None:
    per_rank = spawn_local(_exact_job, world_size, (tiny_config,), timeout_s=600,
                           collective_timeout_s=120)
    r = per_rank[0]
    assert r["chunks"] >= 20, r["chunks"]
    assert r["stream"] == r["one"]["tokens"], (r["stream"], r["one"])
    assert r["again"] == r["stream"], "asking changed the stream"
    assert r["later"] == r["one_later"]["tokens"], (r["later"], r["one_later"])
    errors = [logprob_error(a, b) for a, b in zip(r["choices"], r["one_choices"]["choices"])]
    assert max(errors) <= LOGPROB_RTOL, (
        f"{world_size} rank(s): stream vs one-shot choice logprobs (fp32, merged partials vs "
        f"one causal pass): max relative err {max(errors):.2e} > {LOGPROB_RTOL:g}; "
        f"{r['choices']} vs {r['one_choices']['choices']}")
    tokens = r["tokens_per_rank"]
    # The fewest-tokens placement: ranks differ by at most the header or one chunk (4 tokens).
    assert max(tokens) - min(tokens) <= max(r["header"], 4), (tokens, r["header"])
    for rank, other in enumerate(per_rank):
        assert other["stream"] == r["stream"] and other["choices"] == r["choices"], rank
    print(f"\n{world_size} rank(s): stream == one-shot exact {r['stream']}; choice logprob "
          f"max relative err {max(errors):.2e}")


def _window_job(info: DistInfo, cfg: RuntimeConfig) -> dict:
    engine = Engine(cfg, info)
    frames = _frames(96, seed=1)
    window = dict(height=SIZE, width=SIZE, fps=FPS, window_s=12.0, keep_vision=True)
    engine.open_stream("rebased", StreamSpec(**window, rebase_at=60))
    engine.open_stream("plain", StreamSpec(**window))
    held, out = [], {}
    for i in range(0, len(frames), 2):  # 48 s of video: four times the 12 s window
        stamps = [i / FPS, (i + 1) / FPS]
        for stream in ("rebased", "plain"):
            engine.append(stream, frames[i:i + 2], stamps)
        held.append(engine.streams["rebased"].cache.nbytes())
        if i == 50:  # a bad push on every rank, then different frames on the ranks
            for bad, name in ((frames[i:i + 2, :, :28], "size"),
                              (_frames(2, seed=100 + info.rank), "ranks")):
                try:
                    engine.append("rebased", bad, [100.0, 100.5])
                except ValueError as exc:
                    out[name] = str(exc)
    out["held"] = held
    out["rebased"] = _ask(engine, "rebased", max_new_tokens=NEW_TOKENS).token_ids
    out["plain"] = _ask(engine, "plain", max_new_tokens=NEW_TOKENS).token_ids
    out["rebases"] = engine.describe_stream("rebased").rebases
    out["plain_rebases"] = engine.describe_stream("plain").rebases
    out["frames_held"] = engine.describe_stream("rebased").frames_held
    stream = engine.streams["rebased"]  # the kept embeddings, as every rank receives them
    kept = stream.kept_vision().split([c.patches * stream.tokens_per_patch
                                       for c in stream.chunks])
    out["kept"] = [float(k.double().sum()) for k in kept]
    out["owned"] = {c.index: float(stream.vision[c.index].double().sum())
                    for c in stream.chunks if c.owner == info.rank}
    out["chunk_order"] = [c.index for c in stream.chunks]
    out["fresh"] = _ask(engine, "rebased", max_new_tokens=NEW_TOKENS, fresh=True).token_ids
    kept = frames[len(frames) - out["frames_held"]:]
    out["one_spava"] = _one_shot(engine, kept, "spava", max_new_tokens=NEW_TOKENS)["tokens"]
    text = engine.model.text_config  # one chunk: 4 tokens' K and V in every layer, fp32
    head_dim = text.hidden_size // text.num_attention_heads
    out["chunk_bytes"] = 4 * 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * 4
    return out


def test_window_evicts_rebases_and_fresh(tiny_config: RuntimeConfig) -> None:
    per_rank = spawn_local(_window_job, 2, (tiny_config,), timeout_s=600,
                           collective_timeout_s=120)
    r = per_rank[0]
    assert r["rebases"] >= 1 and r["plain_rebases"] == 0, (r["rebases"], r["plain_rebases"])
    assert r["rebased"] == r["plain"], ("re-basing changed the answer", r["rebased"], r["plain"])
    assert r["fresh"] == r["one_spava"], (r["fresh"], r["one_spava"])
    owned = {i: v for other in per_rank for i, v in other["owned"].items()}
    assert all(other["owned"] for other in per_rank), "one rank owns every held chunk"
    for rank, other in enumerate(per_rank):  # each owner's rows, in chunk order, bit for bit
        assert other["kept"] == [owned[i] for i in r["chunk_order"]], rank
    assert r["frames_held"] <= 26, r["frames_held"]  # 12 s at 2 fps, plus the newest chunk
    chunk = r["chunk_bytes"]  # 4 tokens per chunk
    for rank, other in enumerate(per_rank):
        late = other["held"][len(other["held"]) // 2:]  # the second window onwards
        assert max(late) - min(late) <= chunk, (
            f"rank {rank}: KV bytes vary by {max(late) - min(late)} over the last two "
            f"windows, more than one chunk ({chunk})")
        assert "stream was opened for 56x56" in other["size"], other["size"]
        assert "different frames" in other["ranks"], other["ranks"]
