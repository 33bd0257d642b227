"""scripts/gpu_check.sh's one-GPU multi-rank check, dry run on the CPU (APBV_DRY_RUN=1: device
cpu, H=2), so the script and benchmarks/multirank_check.py cannot rot between GPU loans. The
serve part (a server start) and the calibration (tests/test_cli.py runs its dry run) are left
out to keep it under a minute; the NCCL and graphs parts must say why they are skipped and run
their CPU-side logic."""

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
    # ... and their CPU-side logic ran: the graph case's loop with a real 1-rank all-gather,
    # the bounded read-back of a stuck token, the static decode step kept across requests
    nccl = [line for line in log.splitlines() if line.startswith("[nccl] skipped")]
    assert len(nccl) == 1 and "CPU-side logic: OK" in nccl[0] and "aborted True" in nccl[0], log
    graphs = [line for line in log.splitlines() if line.startswith("[graphs] 1 rank cpu")]
    assert len(graphs) == 1 and ": OK;" in graphs[0] and "steps made 1, reused 1" in graphs[0] \
        and "same tokens True" in graphs[0], log
    assert "multirank_check: 0 failed" in log, log
