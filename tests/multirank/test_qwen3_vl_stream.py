"""A live stream of the tiny Qwen3-VL on 2 gloo ranks (fp32): a question over the held KV equals
one-shot exact on the same frames (``Request(video=DecodedVideo(frames, fps))``: the stock
processor's ``<t seconds>`` from frame i at i / fps, equal to the stream's capture times).

Pushes of 2, 3 and 5 frames (the odd frame waits for the next push) make chunks of 1, 1 and 3
temporal patches, each patch's timestamp text and markers around its video tokens at the
one-shot interleaved M-RoPE positions; each chunk's DeepStack levels travel with its tower rows
and are added after decoder layers 0-2 at its video tokens, as the one-shot prefill adds them.
The greedy tokens are equal and the choices' log-probabilities agree within ``LOGPROB_RTOL``;
the tokens also after one more push; after a window evicted the oldest frames, a fresh ask
(one-shot prefill of the held frames from the kept tower rows, DeepStack levels included, the
timestamps from the first held frame) equals one-shot exact on them; every rank answers alike.
Frames whose sides are multiples of Qwen2.5-VL's 28 but not of Qwen3-VL's 32 are refused at
open."""

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
FPS, HEIGHT, WIDTH, NEW_TOKENS = 3.0, 64, 96, 4
"""3 fps: the patches' times (0.2, 0.8, 1.5, 2.2, 2.8 s, ...) each have their own text."""
PUSHES = (2, 3, 5)
"""Frames per push before the first ask (10 in all: 5 temporal patches); then 2 more."""
PATCH = 16
"""Qwen3-VL's patch size (decoded frames are multiples of 2 x 16 pixels)."""


@pytest.fixture(scope="module")
def qwen3_config(tmp_path_factory: pytest.TempPathFactory) -> RuntimeConfig:
    return tiny_config(tmp_path_factory, "qwen3_vl")


def _answers(engine: Engine, video: DecodedVideo | StreamRef,
             choices: bool = True) -> tuple[list[int], list[float]]:
    """Greedy tokens and (with ``choices``) the choices' log-probabilities."""
    return answers(engine, video, QUESTION, CHOICES, NEW_TOKENS, choices)


def _stream_job(info: DistInfo, cfg: RuntimeConfig) -> dict:
    engine = Engine(cfg, info)
    with pytest.raises(ValueError, match="multiples of 32") as refused:  # 28 is Qwen2.5-VL's
        engine.open_stream("bad", StreamSpec(height=56, width=56))
    assert "56x56" in str(refused.value) and "bad" not in engine.streams
    frames = torch.randint(0, 256, (12, 3, HEIGHT, WIDTH), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(5))
    stamps = [i / FPS for i in range(len(frames))]
    engine.open_stream("s", StreamSpec(height=HEIGHT, width=WIDTH, fps=FPS, keep_vision=True))
    cut = 0
    for n in PUSHES:
        engine.append("s", frames[cut:cut + n], stamps[cut:cut + n])
        cut += n
    out = {"held": _answers(engine, StreamRef("s")),
           "one": _answers(engine, DecodedVideo(frames[:cut], FPS, PATCH)),
           "chunks": engine.describe_stream("s").chunks_held}
    engine.append("s", frames[cut:], stamps[cut:])
    out["later"] = _answers(engine, StreamRef("s"), choices=False)
    out["one_later"] = _answers(engine, DecodedVideo(frames, FPS, PATCH), choices=False)
    # A 1.5 s window over pushes of 2 frames (one patch each) keeps frames 6..11; a fresh ask
    # is the one-shot prompt on them (their timestamps from 0.2 s again).
    engine.open_stream("w", StreamSpec(height=HEIGHT, width=WIDTH, fps=FPS, window_s=1.5,
                                       keep_vision=True))
    for first in range(0, len(frames), 2):
        engine.append("w", frames[first:first + 2], stamps[first:first + 2])
    out["window"] = engine.describe_stream("w").frames_held, engine.generate(Request(
        video=StreamRef("w", fresh=True), question=QUESTION, mode="exact",
        max_new_tokens=NEW_TOKENS)).token_ids
    out["one_window"] = _answers(engine, DecodedVideo(frames[6:], FPS, PATCH), choices=False)[0]
    return out


def test_qwen3_vl_stream_ask_equals_one_shot(qwen3_config: RuntimeConfig) -> None:
    per_rank = spawn_local(_stream_job, 2, (qwen3_config,), timeout_s=600,
                           collective_timeout_s=120)
    r = per_rank[0]
    assert r["chunks"] == len(PUSHES)
    assert len(r["held"][0]) == NEW_TOKENS and len(r["one"][1]) == len(CHOICES)
    check_same(r["held"], r["one"], "after pushes of 2, 3 and 5 frames")
    check_same(r["later"], r["one_later"], "after one more push")
    assert r["window"] == (6, r["one_window"]), (r["window"], r["one_window"])
    assert r["one_window"] != r["one_later"][0], "the window's frames answer alike: no check"
    assert per_rank[1]["held"] == r["held"] and per_rank[1]["later"] == r["later"]
