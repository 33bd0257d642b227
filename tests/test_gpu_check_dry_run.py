"""scripts/gpu_check.sh's one-GPU multi-rank check, dry run on the CPU (APBV_DRY_RUN=1: device
cpu, H=2), so the script and benchmarks/multirank_check.py cannot rot between GPU loans. The
serve part (a server start) and the calibration (tests/test_cli.py runs its dry run) are left
out to keep it under a minute; the NCCL part must say why it is skipped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_on_the_cpu():
    env = dict(os.environ, APBV_DRY_RUN="1", PYTHON=sys.executable, GPU_CHECK_STEPS="1 3",
               MULTIRANK_PARTS="op,engine,nccl,graphs", WHEELS="no-wheels-here")
    out = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "tests/gpu skipped: dry run" in log and "step 2 not chosen" in log, log
    for mode in ("spava", "exact", "zigzag_ring", "star", "apb", "no_overlap"):
        assert f"[op] H=2 cpu float32 {mode}: OK" in log, log
    engine = [line for line in log.splitlines() if line.startswith("[engine] H=2 cpu float32")]
    assert len(engine) == 1 and ": OK; ranks agree True" in engine[0], log
    assert "[nccl] skipped: NCCL needs a CUDA device" in log, log
    assert "[graphs] skipped: CUDA graphs need a CUDA device" in log, log
    assert "multirank_check: 0 failed" in log, log
