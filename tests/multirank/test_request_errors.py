"""Bad requests on 2 gloo ranks: every rank raises a ValueError naming the problem and exits;
the engine stays usable for the next request."""

from __future__ import annotations

from pathlib import Path

import pytest

from apbv.config import RuntimeConfig, load_config
from apbv.distributed import DistInfo, RankFailure, spawn_local
from apbv.engine.engine import Engine


@pytest.fixture(scope="module")
def bad_videos(tmp_path_factory: pytest.TempPathFactory, long_video: Path) -> dict[str, Path]:
    from apbv.synthetic import write_test_video

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


def _requests(info: DistInfo, cfg: RuntimeConfig, videos: dict, good: str) -> list[str]:
    engine = Engine(cfg, info)
    calls = [(str(videos[name]), "What is shown?", None) for name in
             ("missing", "garbage", "truncated", "empty", "one_patch")]
    calls += [(good, "   ", None), (good, "What is shown?", "ring")]
    # Rank-dependent input: only rank 1 gets a missing file.
    calls.append((good if info.rank == 0 else str(videos["missing"]), "What is shown?", None))
    messages = []
    for video, question, mode in calls:
        try:
            engine.generate(video, question, mode=mode, max_new_tokens=1)
            messages.append("no error")
        except ValueError as exc:
            messages.append(str(exc))
    engine.generate(good, "What is shown?", max_new_tokens=1)  # still usable
    return messages


def test_bad_requests_fail_cleanly_on_every_rank(
    tiny_config: RuntimeConfig, bad_videos: dict, short_video: Path
) -> None:
    per_rank = spawn_local(_requests, 2, (tiny_config, bad_videos, str(short_video)),
                           timeout_s=300, collective_timeout_s=60)
    expected = [
        ("nope.mp4", "does not exist"),
        ("garbage.mp4", "cannot be read by decord"),
        ("truncated.mp4", "cannot be read by decord"),
        ("empty.mp4", "cannot be read by decord"),
        ("short.mp4", "has 1 temporal patches (2 frames each) but 2 ranks"),
        ("question must be a non-empty string", ""),
        ("unknown mode 'ring'; allowed: spava, exact, no_overlap", "zigzag_ring, star, apb"),
    ]
    for rank, messages in enumerate(per_rank):
        for (first, second), message in zip(expected, messages):
            assert first in message and second in message, (rank, first, second, message)
    assert "nope.mp4" in per_rank[1][-1] and "does not exist" in per_rank[1][-1]
    assert "failed on another rank" in per_rank[0][-1]


def _load(info: DistInfo, cfg: RuntimeConfig) -> None:
    Engine(cfg, info)


def test_missing_model_directory_fails_on_every_rank(tmp_path: Path) -> None:
    cfg = load_config("tiny_cpu", [f"model.path={str(tmp_path / 'no-model')!r}"])
    with pytest.raises(RankFailure) as info:
        spawn_local(_load, 2, (cfg,), timeout_s=120, collective_timeout_s=30)
    assert set(info.value.errors) == {0, 1}
    for kind, message in info.value.errors.values():
        assert kind == "ValueError" and "no-model" in message and "does not exist" in message
