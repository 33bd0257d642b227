"""A live stream with temporal pruning (``static_threshold``) on 2 gloo ranks, for each family:
exact attention over the pruned stream equals one-shot exact with the same threshold on the
same frames (fp32).

The footage: 8 temporal patches of a fixed scene with sensor noise (+-3 levels); a white
square appears in patch 4 and stays through patch 5, a corner turns black in patch 6. At 8
levels patches 0, 4 and 6 are kept (the one-shot rule over the whole video). Pushed as patches
[0, 1], [2], [3, 4, 5], [6, 7]: the second push keeps nothing (no chunk, no tokens), the third
its middle patch only, each judged against the stream's last kept patch of an earlier push;
the kept patches take the positions (Qwen2.5-VL's M-RoPE time), ``<t seconds>``
(Qwen3-VL) and ``FrameN:`` (InternVL3) of their own capture, so the greedy tokens are the
one-shot ones and the choices' log-probabilities agree within ``LOGPROB_RTOL``. Qwen2.5-VL's
stream takes the threshold from the config (``video.static_threshold``), the others from the
stream's spec.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from apbv.config import RuntimeConfig, load_config
from apbv.distributed import DistInfo, spawn_local
from apbv.engine.engine import Engine
from apbv.engine.request import Request, StreamRef
from apbv.engine.stream_plan import StreamSpec
from apbv.video import DecodedVideo
from tests.families import check_same, tiny_dir

QUESTION = "What changed in the scene?"
CHOICES = ("yes", "no", "a white square")
THRESHOLD, FPS, NEW_TOKENS = 8.0, 2.0, 4
PUSHES = ((0, 2), (2, 3), (3, 6), (6, 8))
"""Temporal patches [p0, p1) per push."""
KEPT = (0, 4, 6)
UNIT = {"qwen2_5_vl": 2, "qwen3_vl": 2, "internvl": 1}
SIDE = {"qwen2_5_vl": 28, "qwen3_vl": 32, "internvl": 28}


def footage(family: str) -> torch.Tensor:
    """uint8 (8 x unit, 3, 2 x side, 3 x side): the scene above."""
    side, unit = SIDE[family], UNIT[family]
    generator = torch.Generator().manual_seed(3)
    scene = torch.randint(40, 200, (3, 2 * side, 3 * side), generator=generator)
    frames = []
    for i in range(8 * unit):
        frame = scene + torch.randint(-3, 4, scene.shape, generator=generator)
        if 4 <= i // unit <= 5:
            frame[:, :side // 2, :side // 2] = 255
        if i // unit >= 6:
            frame[:, side:, 2 * side:] = 0
        frames.append(frame.clamp(0, 255).to(torch.uint8))
    return torch.stack(frames)


def _answers(engine: Engine, video: DecodedVideo | StreamRef,
             threshold: float) -> tuple[list[int], list[float]]:
    said = engine.generate(Request(video=video, question=QUESTION, mode="exact",
                                   max_new_tokens=NEW_TOKENS, static_threshold=threshold))
    scored = engine.generate(Request(video=video, question=QUESTION, mode="exact",
                                     choices=CHOICES, static_threshold=threshold))
    assert scored.choices is not None
    return said.token_ids, [c["logprob"] for c in scored.choices]


def _job(info: DistInfo, configs: dict[str, RuntimeConfig]) -> dict:
    out = {}
    for family, cfg in configs.items():
        engine = Engine(cfg, info)
        frames, unit, side = footage(family), UNIT[family], SIDE[family]
        stamps = [i / FPS for i in range(len(frames))]
        from_config = family == "qwen2_5_vl"
        engine.open_stream("s", StreamSpec(height=frames.shape[2], width=frames.shape[3],
                                           fps=FPS,
                                           static_threshold=None if from_config else THRESHOLD))
        pushed = []
        for p0, p1 in PUSHES:
            a = engine.append("s", frames[p0 * unit:p1 * unit], stamps[p0 * unit:p1 * unit])
            pushed.append((a.chunk is not None, a.tokens, a.patches, a.kept))
        info_ = engine.describe_stream("s")
        out[family] = {
            "pushed": pushed, "pruned": info_.patches_pruned, "held": info_.frames_held,
            "stream": _answers(engine, StreamRef("s"), 0.0),
            "one": _answers(engine, DecodedVideo(frames, FPS, side // 2), THRESHOLD),
            "unpruned": _answers(engine, DecodedVideo(frames, FPS, side // 2), 0.0)}
    return out


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict:
    model = load_config("tiny_cpu", [f"model.path={str(tiny_model_dir)!r}",
                                     f"video.static_threshold={THRESHOLD}"])
    return {"qwen2_5_vl": model} | {
        f: load_config("tiny_cpu", [f"model.path={str(tiny_dir(tmp_path_factory, f))!r}"])
        for f in ("qwen3_vl", "internvl")}


def test_pruned_stream_equals_one_shot_pruning(configs: dict) -> None:
    per_rank = spawn_local(_job, 2, (configs,), timeout_s=600, collective_timeout_s=120)
    for family, r in per_rank[0].items():
        assert [(chunk, tokens > 0, patches, kept) for chunk, tokens, patches, kept
                in r["pushed"]] == [(True, True, 2, 1), (False, False, 1, 0),
                                    (True, True, 3, 1), (True, True, 2, 1)], (family, r)
        assert r["pruned"] == 8 - len(KEPT) and r["held"] == len(KEPT) * UNIT[family], r
        check_same(r["stream"], r["one"], f"{family}: a pruned stream vs one-shot pruning")
        assert r["one"] != r["unpruned"], f"{family}: pruning changed nothing: no check"
        assert per_rank[1][family]["stream"] == r["stream"], family
