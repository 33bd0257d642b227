"""Start-up skew does not fail a job: ``apbv generate`` on 2 gloo ranks under torchrun, with a
collective timeout of 20 s and rank 1 arriving 60 s late after its model load (the test-only
``APBV_TEST_LATE_RANK``), still answers; rank 0 names rank 1 while it waits. Without the
start-up barrier the first request's first collective would wait the 60 s and fail at 20 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from apbv.distributed import LATE_RANK_ENV

ROOT = Path(__file__).resolve().parents[2]
HOLD_S = 60


def test_generate_answers_when_one_rank_loads_a_minute_late(tiny_model_dir, short_video) -> None:
    env = dict(os.environ, NPROC="2", PYTHON=sys.executable, LOG_RANK="0",
               **{LATE_RANK_ENV: f"1:{HOLD_S}"})
    cmd = ["bash", "launch/generate.sh", "--model", str(tiny_model_dir), "--video",
           str(short_video), "--question", "What is shown?", "--max-new-tokens", "2", "--json",
           "--set", "parallel.timeout_s=20"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=HOLD_S + 240)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["world_size"] == 2 and report["answer"] is not None
    waits = [line for line in result.stderr.splitlines()
             if "rank 0: waiting for rank(s) 1 at the start-up point '1-model loaded'" in line]
    # Reported every 30 s while rank 1 is held back 60 s: at about 30 s and 60 s.
    assert len(waits) >= 1, result.stderr[-3000:]
    assert "parallel.startup_timeout_s = 1800 s" in waits[0], waits[0]
