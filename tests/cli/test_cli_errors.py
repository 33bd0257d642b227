"""Bad input through the command line: exit status 2 and one `error:` line naming the problem,
before work is spent (the checks behind each line have their own unit tests)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from apbv.__main__ import main
from apbv.synthetic.videos import write_test_video


def _generate(model: Path | str, video: Path, *flags: str) -> list[str]:
    return ["generate", "--config", "tiny_cpu", "--model", str(model), "--video", str(video),
            "--question", "What is shown?", *flags]


LOAD_LINES = ("rank 0: loading the model: ", "rank 0: model loaded in ")
"""Rank 0's model-load progress (apbv.engine.load_progress), printed before a request's error."""


def _one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.startswith(LOAD_LINES)]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="module")
def broken_models(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict:
    root = tmp_path_factory.mktemp("broken")
    truncated = shutil.copytree(tiny_model_dir, root / "truncated")
    text = (truncated / "config.json").read_text()
    (truncated / "config.json").write_text(text[: len(text) // 2])
    no_weights = shutil.copytree(tiny_model_dir, root / "no-weights")
    for weights in no_weights.glob("*.safetensors*"):
        weights.unlink()
    text_only = root / "text-only"
    text_only.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (text_only / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    return {"truncated": truncated, "no_weights": no_weights, "text_only": text_only}


@pytest.mark.parametrize("name, message", [
    ("truncated", "not valid JSON"),
    ("no_weights", "weight"),
    ("text_only", "'qwen2'"),
])
def test_broken_checkpoints(capsys, broken_models, short_video, name, message) -> None:
    assert main(_generate(broken_models[name], short_video)) == 2
    line = _one_error_line(capsys)
    assert message in line and str(broken_models[name]) in line, line


def test_an_error_on_every_local_rank_is_one_line(capsys) -> None:
    """The demo's ranks are local processes: the same ValueError on each is one error line."""
    assert main(["demo", "--set", "video.resize_device=cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # after the demo's "[apbv] ..." line
    assert [line for line in err if not line.startswith("[apbv]")] == [
        "error: video.resize_device=cuda needs ranks on CUDA devices; this rank runs on cpu "
        "(use video.resize_device=cpu)"], err


def test_request_errors(capsys, tmp_path, tiny_model_dir, short_video) -> None:
    thin = write_test_video(tmp_path / "thin.mp4", num_frames=8, fps=4.0, width=600, height=20)
    assert main(_generate(tiny_model_dir, thin, "--max-pixels", "2000")) == 2
    assert "would be resized to" in _one_error_line(capsys)
    assert main(_generate(tiny_model_dir, short_video, "--max-new-tokens", "1000000000")) == 2
    assert "generate.max_new_tokens must be an integer in 1 .. 32768" in _one_error_line(capsys)
    assert main(_generate(tiny_model_dir, short_video, "--set", "parallel.memory_gb=0.01")) == 2
    line = _one_error_line(capsys)
    assert "does not fit in memory on rank 0" in line and "parallel.memory_gb is 0.01 GiB" in line


@pytest.mark.parametrize("flags, message", [
    (["--max-queue", "0"], "error: --max-queue must be >= 1, got 0"),
    (["--stream-idle-s", "0"], "error: --max-streams must be >= 0, --stream-idle-s and "
                               "--stream-memory-gb > 0, got 8, 0.0 and None"),
    (["--stream-end-after-s", "-1"], "error: --stream-end-after-s must be >= 0, got -1.0"),
])
def test_serve_refuses_bad_options_before_starting(capsys, flags: list[str], message: str):
    pytest.importorskip("ray")
    assert main(["serve", "--config", "tiny_cpu", *flags]) == 2
    assert _one_error_line(capsys) == message
