"""``python -m apbv watch`` on a small video file: periodic and stdin answers equal one-shot
exact on the same captured frames; a bad source is a clear error exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli.test_cli_errors import LOAD_LINES

ROOT = Path(__file__).resolve().parents[2]
QUESTION = "What colour is the square?"


def _watch(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "apbv", "watch", *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, cwd=ROOT, env=env, input=stdin, capture_output=True, text=True,
                          timeout=300)


def _captured_frames(video: Path) -> list:
    """The frames the watch loop's capture gives for ``video`` (same source, same sampling)."""
    from apbv.capture import Capture, FollowFile

    capture = Capture(FollowFile(video, end_after_s=0.5), fps=2.0, max_pixels=12544,
                      capacity=1000)
    frames, deadline = [], time.monotonic() + 60
    while time.monotonic() < deadline:
        frames += capture.take(timeout=0.5)
        stats = capture.stats()
        if stats["ended"] and not stats["buffered"]:
            break
    capture.close()
    assert stats["error"] is None and not stats["frames_dropped"], stats
    return frames


def test_watch_answers_equal_one_shot_exact(tmp_path, tiny_model_dir) -> None:
    import torch

    from apbv.config import load_config
    from apbv.distributed import init_distributed
    from apbv.engine.engine import Engine
    from apbv.engine.request import Request
    from apbv.synthetic.videos import write_test_video
    from apbv.video import DecodedVideo

    video = write_test_video(tmp_path / "live.mp4", num_frames=40, fps=4.0, width=112,
                             height=112, seed=3)  # 10 s: 20 frames at 2 fps
    run = _watch("--config", "tiny_cpu", "--model", str(tiny_model_dir), "--source", str(video),
                 "--end-after-s", "0.5", "--ask-every", "4", "--question", QUESTION,
                 "--max-pixels", "12544", "--max-new-tokens", "3", "--json",
                 stdin="What is shown?\n")
    assert run.returncode == 0, run.stderr[-3000:]
    events = [json.loads(line) for line in run.stdout.splitlines()]
    answers = [e for e in events if e["event"] == "answer"]
    periodic = [(e["trigger"], e["frames_held"]) for e in answers if e["trigger"] != "stdin"]
    assert periodic == [("every", 8), ("every", 16), ("end", 20)], events
    assert [e["question"] for e in answers if e["trigger"] == "stdin"] == ["What is shown?"]
    end = events[-1]
    assert end["event"] == "end" and end["reason"] == "the source ended", end
    assert end["frames_appended"] == 20 and end["frames_dropped"] == 0
    for e in answers:
        assert e["ttft_s"] > 0 and e["lag_s"] >= 0 and len(e["token_ids"]) <= 3

    frames = _captured_frames(video)
    assert len(frames) == 20
    images = torch.stack([f.image for f in frames])
    cfg = load_config("tiny_cpu", [f"model.path={str(tiny_model_dir)!r}"])
    engine = Engine(cfg, init_distributed(backend="gloo"))
    for e in answers:
        exact = engine.generate(Request(video=DecodedVideo(images[:e["frames_held"]], 2.0),
                                        question=e["question"], mode="exact",
                                        max_new_tokens=3))
        assert e["token_ids"] == exact.token_ids, (e, exact.token_ids)


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing.mp4", "is not a URL, a directory or an existing file"),
    (lambda d: (d / "noise.ts").write_bytes(b"not a video " * 100) and d / "noise.ts",
     "the source failed before any frame"),
])
def test_watch_bad_source_is_a_clear_error(capsys, tmp_path, tiny_model_dir, make,
                                           message) -> None:
    from apbv.__main__ import main

    code = main(["watch", "--config", "tiny_cpu", "--model", str(tiny_model_dir), "--source",
                 str(make(tmp_path)), "--end-after-s", "0.5", "--ask-every", "4",
                 "--question", QUESTION])
    err = "\n".join(line for line in capsys.readouterr().err.splitlines()
                    if not line.startswith(LOAD_LINES))  # rank 0's load progress comes first
    assert code == 2 and err.startswith("error: ") and message in err, err
