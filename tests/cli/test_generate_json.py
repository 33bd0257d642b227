"""The first hour's needle: ``make-test-video --needle magenta`` writes a video the trained tiny
model answers right about, and ``generate --json`` writes only JSON to stdout (piped into
``python -m json.tool``, as a user would)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from apbv.__main__ import main

ROOT = Path(__file__).resolve().parents[2]


def test_needle_video_and_generate_json(tmp_path: Path, capsys) -> None:
    video = tmp_path / "media" / "needle.mp4"
    assert main(["make-test-video", "--needle", "magenta", "--out", str(video)]) == 0
    assert capsys.readouterr().out.strip() == str(video)
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    generate = subprocess.Popen(
        [sys.executable, "-m", "apbv", "generate", "--config", "tiny_cpu", "--model",
         str(ROOT / "apbv" / "assets" / "needle-tiny"), "--min-pixels", "3136",
         "--max-pixels", "3136", "--video", str(video), "--question",
         "What colour is the flash?", "--json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tool = subprocess.run([sys.executable, "-m", "json.tool"], stdin=generate.stdout,
                          capture_output=True, text=True, timeout=180)
    generate.stdout.close()
    err = generate.communicate(timeout=180)[1].decode()
    assert generate.returncode == 0, err[-3000:]
    assert tool.returncode == 0, tool.stderr  # stdout held nothing but the JSON
    assert json.loads(tool.stdout)["answer"] == "magenta"
    assert "answer: 'magenta'" in err  # the human lines went to stderr
