"""scripts/gpu_check.sh on the CPU (APBV_DRY_RUN=1), so the GPU check cannot rot between GPU
loans: ``--first-run`` runs every part's CPU side (the multi-rank parts on 2 CPU ranks,
tests/gpu skipping with their reasons), says which parts need a GPU, and prints a worst case
within 10 minutes; it refuses a first run whose limits add up to more; NVDEC's torchcodec
check. The serve part (a server start) and the calibration (tests/cli/test_cli.py runs its dry
run) are left out to keep this under a minute and a half."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *args: str, **env: str) -> tuple[int, str]:
    full = dict(os.environ, APBV_DRY_RUN="1", PYTHON=sys.executable, WHEELS="no-wheels-here",
                GPU_CHECK_LOG=str(tmp_path / "gpu_check.log"), **env)
    out = subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=ROOT, env=full,
                         capture_output=True, text=True, timeout=300)
    return out.returncode, out.stdout + out.stderr


def test_first_run_dry_run_on_the_cpu(tmp_path: Path) -> None:
    code, log = _run(tmp_path, "--first-run")
    assert code == 0, log[-4000:]
    worst = re.search(r"worst case (\d+) s \(install (\d+) \+ op (\d+) \+ engine (\d+) \+ "
                      r"nccl (\d+) \+ graphs (\d+) \+ gpu_tests (\d+)\)", log)
    assert worst, log[:2000]
    total, *limits = (int(x) for x in worst.groups())
    assert total == sum(limits) <= 600, worst.group(0)
    assert "no torch wheel in no-wheels-here" in log
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
    assert re.search(r"SKIPPED \[\d+\] tests/gpu/\S+: needs a CUDA device", log), log
    summary = log[log.index("== summary"):].splitlines()
    rows = {line.split()[0]: line for line in summary[2:-1]}
    assert list(rows) == ["install", "op", "engine", "nccl", "graphs", "gpu_tests"], summary
    assert "GPU (NCCL)" in rows["nccl"] and "GPU (CUDA graphs)" in rows["graphs"], summary
    assert "no GPU" in rows["install"] and "skipped on the CPU" in rows["gpu_tests"], summary
    assert all(line.rstrip().endswith("OK") for line in rows.values()), summary
    assert summary[-1].startswith("gpu_check: 0 failed"), summary
    assert (tmp_path / "gpu_check.log").read_text() == log  # the one log has it all


def test_refusals_and_the_nvdec_check(tmp_path: Path) -> None:
    code, log = _run(tmp_path, "--first-run", FIRST_RUN_PARTS="install op calibrate serve")
    assert code == 2 and "worst case 720 s" in log and "is over 600 s" in log, log
    assert "== op" not in log  # refused before any work
    code, log = _run(tmp_path, "--parts", "op,warp")
    assert code == 2 and "unknown part 'warp'; allowed: install" in log, log
    assert "graphs" in log.splitlines()[-1]  # multirank_check.py's parts are allowed too
    code, log = _run(tmp_path, "--parts", "nvdec")
    assert code == 0, log
    assert "NVDEC needs a GPU; torchcodec's version check only" in log, log
    assert "nvdec_check: torchcodec is not installed" in log, log
    assert re.search(r"nvdec +\d+ +300 .*not counted", log), log


def test_torchcodec_coupling_table() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import nvdec_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert nvdec_check.coupling("0.8.1", "2.9.0+cu128") is None
    assert nvdec_check.coupling("0.7.0", "2.8.1") is None
    why = nvdec_check.coupling("0.9.0", "2.14.1+cu130")
    assert why == ("torchcodec 0.9.0 is built for torch 2.9, not 2.14.1+cu130: install the "
                   "torchcodec of torch 2.14"), why
    assert nvdec_check.coupling("0.17.0", "2.14.1") is None  # newer: its import decides
