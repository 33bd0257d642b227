"""A live stream of each tiny family (:data:`tests.families.FAMILIES`) on 2 gloo ranks (fp32):
a question over the held KV equals one-shot exact on the same frames
(``Request(video=DecodedVideo(frames, fps))``): the greedy tokens are equal and the choices'
log-probabilities agree within ``LOGPROB_RTOL`` after the family's pushes, the tokens also
after one more push; a fresh ask (one-shot prefill of the held frames from the kept tower
rows) equals it too, also after a window evicted the oldest frames, and every rank answers
alike. Frames whose sides are not multiples of the family's frame multiple are refused at open.

InternVL3: each frame its own temporal unit, each chunk's ``FrameN`` text numbered on from the
frames before it. Qwen3-VL: the stock processor's ``<t seconds>`` from frame i at i / fps,
equal to the stream's capture times; each patch's timestamp text and markers around its video
tokens at the one-shot interleaved M-RoPE positions; each chunk's DeepStack levels travel with
its tower rows and are added after decoder layers 0-2 at its video tokens, as the one-shot
prefill adds them; a fresh ask's timestamps start from the first held frame."""

from __future__ import annotations

import pytest
import torch

from apbv.config import RuntimeConfig
from apbv.distributed import DistInfo, spawn_local
from apbv.engine.engine import Engine
from apbv.engine.request import Request, StreamRef
from apbv.engine.stream_plan import StreamSpec
from apbv.video import DecodedVideo
from tests.families import FAMILIES, Family, answers, check_same, tiny_config

QUESTION = "Which colour comes after the blue one?"
CHOICES = ("red", "blue square")
NEW_TOKENS = 4
LATER = 2
"""Frames in the push after the first ask."""


def _answers(engine: Engine, video: DecodedVideo | StreamRef,
             choices: bool = True) -> tuple[list[int], list[float]]:
    """Greedy tokens and (with ``choices``) the choices' log-probabilities."""
    return answers(engine, video, QUESTION, CHOICES, NEW_TOKENS, choices)


def _stream_job(info: DistInfo, cfg: RuntimeConfig, row: Family) -> dict:
    engine = Engine(cfg, info)
    height, width = row.stream_hw
    bad = row.refused_hw
    with pytest.raises(ValueError, match=f"multiples of {row.frame_multiple}") as refused:
        engine.open_stream("bad", StreamSpec(height=bad[0], width=bad[1]))
    assert f"{bad[0]}x{bad[1]}" in str(refused.value) and "bad" not in engine.streams
    fps, total = row.stream_fps, sum(row.pushes) + LATER
    frames = torch.randint(0, 256, (total, 3, height, width), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(5))
    stamps = [i / fps for i in range(len(frames))]

    def decoded(part: torch.Tensor) -> DecodedVideo:
        return DecodedVideo(part, fps, row.patch)

    engine.open_stream("s", StreamSpec(height=height, width=width, fps=fps, keep_vision=True))
    cut = 0
    for n in row.pushes:
        engine.append("s", frames[cut:cut + n], stamps[cut:cut + n])
        cut += n
    out = {"held": _answers(engine, StreamRef("s")), "one": _answers(engine, decoded(frames[:cut])),
           "chunks": engine.describe_stream("s").chunks_held}
    engine.append("s", frames[cut:], stamps[cut:])
    out["later"] = _answers(engine, StreamRef("s"), choices=False)
    out["one_later"] = _answers(engine, decoded(frames), choices=False)
    out["fresh"] = engine.generate(Request(video=StreamRef("s", fresh=True), question=QUESTION,
                                           mode="exact", max_new_tokens=NEW_TOKENS)).token_ids
    # A 1.5 s window over pushes of 2 frames keeps the last ones; a fresh ask is the one-shot
    # prompt on them (InternVL3's frames numbered from 1, Qwen3-VL's times from 0 again).
    engine.open_stream("w", StreamSpec(height=height, width=width, fps=fps, window_s=1.5,
                                       keep_vision=True))
    for first in range(0, len(frames), 2):
        engine.append("w", frames[first:first + 2], stamps[first:first + 2])
    out["window"] = engine.describe_stream("w").frames_held, engine.generate(Request(
        video=StreamRef("w", fresh=True), question=QUESTION, mode="exact",
        max_new_tokens=NEW_TOKENS)).token_ids
    kept = len(frames) - row.window_kept
    out["one_window"] = _answers(engine, decoded(frames[kept:]), choices=False)[0]
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stream_ask_equals_one_shot(family: str,
                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    row = FAMILIES[family]
    per_rank = spawn_local(_stream_job, 2, (tiny_config(tmp_path_factory, family), row),
                           timeout_s=600, collective_timeout_s=120)
    r = per_rank[0]
    assert r["chunks"] == len(row.pushes)
    assert len(r["held"][0]) == NEW_TOKENS and len(r["one"][1]) == len(CHOICES)
    check_same(r["held"], r["one"], f"after pushes of {row.pushes} frames")
    check_same(r["later"], r["one_later"], "after one more push")
    assert r["fresh"] == r["one_later"][0], (r["fresh"], r["one_later"][0])
    assert r["window"] == (row.window_kept, r["one_window"]), (r["window"], r["one_window"])
    assert r["one_window"] != r["one_later"][0], "the window's frames answer alike: no check"
    assert per_rank[1]["held"] == r["held"] and per_rank[1]["later"] == r["later"]
