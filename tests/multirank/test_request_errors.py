"""Bad requests on 2 gloo ranks: every rank raises a ValueError naming the problem, within
seconds (not the collective timeout), also when the ranks were given different requests or only
one rank fails; the engine stays usable for the next request."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from apbv.config import RuntimeConfig, load_config
from apbv.distributed import DistInfo, RankFailure, spawn_local
from apbv.engine.engine import Engine


@pytest.fixture(scope="module")
def bad_videos(tmp_path_factory: pytest.TempPathFactory, long_video: Path) -> dict[str, Path]:
    from apbv.synthetic.videos import write_test_video

    root = tmp_path_factory.mktemp("bad")
    garbage = root / "garbage.mp4"
    garbage.write_bytes(bytes(range(256)) * 64)
    truncated = root / "truncated.mp4"
    data = long_video.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    empty = write_test_video(root / "empty.mp4", num_frames=0, fps=4.0, width=64, height=64)
    one_patch = write_test_video(root / "short.mp4", num_frames=2, fps=4.0, width=64, height=64)
    return {"missing": root / "nope.mp4", "garbage": garbage, "truncated": truncated,
            "empty": empty, "one_patch": one_patch}


def _outcome(call) -> str:
    start = time.monotonic()
    try:
        call()
        outcome = "no error"
    except Exception as exc:  # noqa: BLE001 - the test records every kind
        outcome = f"{type(exc).__name__}: {exc}"
    return f"{outcome} [{time.monotonic() - start:.1f} s]"


def _requests(info: DistInfo, cfg: RuntimeConfig, videos: dict, good: str) -> list[str]:
    engine = Engine(cfg, info)

    def ask(video: str, question: str = "What is shown?", **kw) -> None:
        engine.generate(engine.request(video, question, **{"max_new_tokens": 1, **kw}))

    calls = [lambda name=name: ask(str(videos[name])) for name in
             ("missing", "garbage", "truncated", "empty", "one_patch")]
    calls += [lambda: ask(good, "   "), lambda: ask(good, mode="ring"),
              lambda: ask(good, max_new_tokens=128000)]
    # Rank-dependent requests: the ranks must notice before any model collective.
    other = info.rank == 1
    calls += [
        lambda: ask(str(videos["missing"]) if other else good),
        lambda: ask(good, "What is drawn?" if other else "What is shown?"),  # equal shapes
        lambda: ask(good, mode="exact" if other else "spava"),
        lambda: engine.generate(dataclasses.replace(
            engine.request(good, "What is shown?", max_new_tokens=1),
            video=cfg.video.spec(good) if not other else dataclasses.replace(
                cfg.video.spec(good), fps=None, nframes=8))),
    ]
    messages = [_outcome(call) for call in calls]
    # A request that cannot fit the configured memory is refused before decoding.
    engine.cfg.parallel.memory_gb = 0.05
    messages.append(_outcome(lambda: ask(good)))
    engine.cfg.parallel.memory_gb = None
    # An unexpected error on one rank only (not a ValueError) while preprocessing.
    real = engine.preprocess

    def broken(request):
        if other:
            raise RuntimeError("decoder crashed")
        return real(request)

    engine.preprocess = broken
    messages.append(_outcome(lambda: ask(good)))
    engine.preprocess = real
    ask(good)  # still usable
    return messages


def test_bad_requests_fail_cleanly_on_every_rank(
    tiny_config: RuntimeConfig, bad_videos: dict, short_video: Path
) -> None:
    per_rank = spawn_local(_requests, 2, (tiny_config, bad_videos, str(short_video)),
                           timeout_s=300, collective_timeout_s=60)
    expected = [
        ("ValueError", "nope.mp4", "does not exist"),
        ("ValueError", "garbage.mp4", "cannot be read by decord"),
        ("ValueError", "truncated.mp4", "cannot be read by decord"),
        ("ValueError", "empty.mp4", "cannot be read by decord"),
        ("ValueError", "short.mp4", "has 1 temporal patches (2 frames each) but 2 ranks"),
        ("ValueError", "question must be a non-empty string", ""),
        ("ValueError", "unknown mode 'ring'; allowed: spava, exact, no_overlap", "zigzag_ring"),
        ("ValueError", "plus max_new_tokens (128000)", "beyond the model's context of 128000"),
        ("ValueError", "different requests (video.path, video.size differ)", "nope.mp4"),
        ("ValueError", "different requests (question differ)", "rank 1 'What is drawn?'"),
        ("ValueError", "different requests (mode differ)", "rank 0 spava, rank 1 exact"),
        ("ValueError", "different requests (video.fps, video.nframes differ)", "rank 1 8"),
        ("ValueError", "does not fit in memory on rank", "the budget parallel.memory_gb is 0.05 "
         "GiB: sample fewer frames"),
    ]
    for rank, messages in enumerate(per_rank):
        for (kind, first, second), message in zip(expected, messages):
            assert message.startswith(kind) and first in message and second in message, (
                rank, first, second, message)
            seconds = float(message.rsplit("[", 1)[1].split()[0])
            assert seconds < 30, f"rank {rank} took {seconds} s to refuse: {message}"
    assert per_rank[1][-1].startswith("RuntimeError: decoder crashed"), per_rank[1][-1]
    assert per_rank[0][-1].startswith(
        "RequestFailed: the request failed on rank 1: RuntimeError: decoder crashed"), per_rank[0]


def _load(info: DistInfo, cfg: RuntimeConfig) -> None:
    Engine(cfg, info)


def test_missing_model_directory_fails_on_every_rank(tmp_path: Path) -> None:
    cfg = load_config("tiny_cpu", [f"model.path={str(tmp_path / 'no-model')!r}"])
    with pytest.raises(RankFailure) as info:
        spawn_local(_load, 2, (cfg,), timeout_s=120, collective_timeout_s=30)
    assert set(info.value.errors) == {0, 1}
    for kind, message in info.value.errors.values():
        assert kind == "ValueError" and "no-model" in message and "does not exist" in message
