"""video.keyframe_split through the engine on 2 and 3 gloo ranks: each rank decodes and encodes
the keyframe-aligned share (apbv.video.gop.frame_split), routing moves the embedding rows to
their owners, and the answer is the balanced split's: the same tokens and first-token logits.
With video.snap_to_keyframes the result lists the sampled frames that moved."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from apbv.config import RuntimeConfig
from apbv.distributed import DistInfo, spawn_local
from apbv.engine.engine import Engine
from apbv.engine.runner import run_prompt
from apbv.plan import patch_ranges
from apbv.timing import StageTimer
from apbv.video import VideoSpec, plan_sampling, probe

QUESTION = "What moves across the scene?"
SNAP_S = 0.5
LOGIT_RTOL = 1e-4
"""Of the logits' largest magnitude (fp32: the tower encodes other batches of the same patches,
so the matrix products block differently with the batch and, on a busy machine, the threads:
bit-equal when run alone, 1.7e-5 of the scale measured under a loaded test run)."""


@pytest.fixture(scope="module")
def gop_video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """9 s of 112x112 camera footage at 10 fps, a keyframe every 2 s, 2 B-frames: 18 frames
    sampled at 2 fps (9 patches), whose balanced split on 2 and 3 ranks cuts a keyframe
    interval that the aligned split does not."""
    from apbv.video.footage import write_camera_video

    return write_camera_video(tmp_path_factory.mktemp("video") / "gop.mp4", seconds=9, fps=10,
                              width=112, height=112, gop_seconds=2.0, bframes=2)


def _job(info: DistInfo, cfg: RuntimeConfig, video: str) -> dict:
    engine = Engine(cfg, info)
    out = {}
    for name, change in (("balanced", {}), ("aligned", {"keyframe_split": True}),
                         ("snapped", {"snap_to_keyframes": SNAP_S})):
        request = engine.request(video, QUESTION, mode="spava", max_new_tokens=4)
        request = dataclasses.replace(request, video=dataclasses.replace(request.video,
                                                                         **change))
        inputs = engine.preprocess(request)
        result = run_prompt(engine.model, inputs, request, info, StageTimer(info.device))
        out[name] = (inputs.patch_ranges, result.token_ids, result.first_logits,
                     result.to_json()["snapped_frames"])
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_keyframe_split_gives_the_balanced_answer(world_size: int, tiny_config: RuntimeConfig,
                                                  gop_video: Path) -> None:
    cfg = dataclasses.replace(tiny_config, video=dataclasses.replace(
        tiny_config.video, backend="pyav", fps=2.0))
    per_rank = spawn_local(_job, world_size, (cfg, str(gop_video)), timeout_s=300,
                           collective_timeout_s=120)
    balanced, tokens, logits, snapped = per_rank[0]["balanced"]
    aligned = per_rank[0]["aligned"][0]
    assert balanced == patch_ranges(9, world_size)
    # keyframes at frames 0, 20, 40, ...; samples at linspace(0, 89, 18): the split moved.
    assert aligned == {2: ((0, 4), (4, 9)), 3: ((0, 2), (2, 6), (6, 9))}[world_size], aligned
    assert len(set(tokens)) > 1, tokens  # not a degenerate answer
    assert snapped is None  # exact sampling: nothing moved, nothing to report
    spec = VideoSpec(str(gop_video), fps=2.0, backend="pyav", snap_to_keyframes=SNAP_S)
    moved = plan_sampling(spec, probe(spec)).moved
    assert moved, "the test video must have sampled frames within 0.5 s of a keyframe"
    want = [{"position": p, "frame": i, "keyframe": k} for p, i, k in moved]
    for rank, r in enumerate(per_rank):
        assert r["aligned"][0] == aligned and r["balanced"][0] == balanced, (rank, r)
        assert r["aligned"][1] == tokens and r["balanced"][1] == tokens, (rank, r, tokens)
        err = (r["aligned"][2] - logits).abs().max().item()
        tol = LOGIT_RTOL * logits.abs().max().item()
        assert err <= tol, (f"rank {rank}: keyframe split's first logits differ by {err:.2e} "
                            f"(allowed {tol:.2e}: {LOGIT_RTOL:g} of their largest magnitude)")
        assert r["snapped"][3] == want, (rank, r["snapped"][3], want)
