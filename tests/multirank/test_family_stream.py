"""A live stream of the tiny InternVL3 on 2 gloo ranks (fp32): a question over the held KV
equals one-shot exact on the same frames (``Request(video=DecodedVideo(frames, fps))``, each
frame its own temporal unit): the greedy tokens are equal and the choices' log-probabilities
agree within ``LOGPROB_RTOL`` after pushes of 1, 2 and 3 frames (each chunk's ``FrameN`` text
numbered on from the frames before it), the tokens also after one more push; a fresh ask
(one-shot prefill of the held frames from the kept embeddings) equals it too, also after a
window evicted the oldest frames, and every rank answers alike."""

from __future__ import annotations

import pytest
import torch

from apbv.config import RuntimeConfig
from apbv.distributed import DistInfo, spawn_local
from apbv.engine.engine import Engine
from apbv.engine.request import Request, StreamRef
from apbv.engine.stream_plan import StreamSpec
from apbv.video import DecodedVideo
from tests.families import answers, check_same, tiny_config

QUESTION = "Which colour comes after the blue one?"
CHOICES = ("red", "blue square")
FPS, SIZE, NEW_TOKENS = 2.0, 56, 4
PUSHES = (1, 2, 3)
"""Frames per push before the first ask (6 in all); then one push of 2 more."""


@pytest.fixture(scope="module")
def internvl_config(tmp_path_factory: pytest.TempPathFactory) -> RuntimeConfig:
    return tiny_config(tmp_path_factory, "internvl")


def _answers(engine: Engine, video: DecodedVideo | StreamRef,
             choices: bool = True) -> tuple[list[int], list[float]]:
    """Greedy tokens and (with ``choices``) the choices' log-probabilities."""
    return answers(engine, video, QUESTION, CHOICES, NEW_TOKENS, choices)


def _stream_job(info: DistInfo, cfg: RuntimeConfig) -> dict:
    engine = Engine(cfg, info)
    frames = torch.randint(0, 256, (8, 3, SIZE, SIZE), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(5))
    stamps = [i / FPS for i in range(len(frames))]
    engine.open_stream("s", StreamSpec(height=SIZE, width=SIZE, fps=FPS, keep_vision=True))
    cut = 0
    for n in PUSHES:
        engine.append("s", frames[cut:cut + n], stamps[cut:cut + n])
        cut += n
    out = {"held": _answers(engine, StreamRef("s")),
           "one": _answers(engine, DecodedVideo(frames[:cut], FPS)),
           "chunks": engine.describe_stream("s").chunks_held}
    engine.append("s", frames[cut:], stamps[cut:])
    out["later"] = _answers(engine, StreamRef("s"), choices=False)
    out["one_later"] = _answers(engine, DecodedVideo(frames, FPS), choices=False)
    out["fresh"] = engine.generate(Request(video=StreamRef("s", fresh=True), question=QUESTION,
                                           mode="exact", max_new_tokens=NEW_TOKENS)).token_ids
    # A 1.5 s window over pushes of 2 frames keeps the last two: frames 4..7 (numbered 5..8 in
    # the held KV); a fresh ask is the one-shot prompt on them (numbered 1..4).
    engine.open_stream("w", StreamSpec(height=SIZE, width=SIZE, fps=FPS, window_s=1.5,
                                       keep_vision=True))
    for first in range(0, len(frames), 2):
        engine.append("w", frames[first:first + 2], stamps[first:first + 2])
    out["window"] = engine.describe_stream("w").frames_held, engine.generate(Request(
        video=StreamRef("w", fresh=True), question=QUESTION, mode="exact",
        max_new_tokens=NEW_TOKENS)).token_ids
    out["one_window"] = _answers(engine, DecodedVideo(frames[4:], FPS), choices=False)[0]
    return out


def test_internvl_stream_ask_equals_one_shot(internvl_config: RuntimeConfig) -> None:
    per_rank = spawn_local(_stream_job, 2, (internvl_config,), timeout_s=600,
                           collective_timeout_s=120)
    r = per_rank[0]
    assert r["chunks"] == len(PUSHES)
    check_same(r["held"], r["one"], "after pushes of 1, 2 and 3 frames")
    check_same(r["later"], r["one_later"], "after one more push")
    assert r["fresh"] == r["one_later"][0], (r["fresh"], r["one_later"][0])
    assert r["window"] == (4, r["one_window"]), (r["window"], r["one_window"])
    assert per_rank[1]["held"] == r["held"] and per_rank[1]["later"] == r["later"]
