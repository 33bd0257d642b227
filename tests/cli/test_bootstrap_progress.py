"""scripts/bootstrap.sh says what it installs (a line per package on stderr, pip's whole output
in the log) and still fails when pip fails: a copy of the script run in a temporary directory
with a fake ``python -m venv`` whose pip prints what pip prints (no package is installed)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAKE_PYTHON = """#!/usr/bin/env bash
mkdir -p .venv/bin
cat > .venv/bin/pip <<'PIP'
#!/usr/bin/env bash
echo "Collecting $2"; echo "  Downloading $2.whl (1 MB)"; echo "Installing collected packages: $2"
echo "Successfully installed $2"; [ "$2" != "broken" ]
PIP
printf '#!/bin/sh\\n' > .venv/bin/python
chmod +x .venv/bin/pip .venv/bin/python
"""


def _run(tmp_path: Path, torch_spec: str) -> subprocess.CompletedProcess:
    (tmp_path / "scripts").mkdir(exist_ok=True)
    shutil.copy(ROOT / "scripts" / "bootstrap.sh", tmp_path / "scripts" / "bootstrap.sh")
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    shutil.rmtree(tmp_path / ".venv", ignore_errors=True)
    env = {**os.environ, "PYTHON": str(fake), "APBV_TORCH": torch_spec}
    return subprocess.run(["bash", "scripts/bootstrap.sh"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_line_per_package_and_the_log(tmp_path: Path) -> None:
    done = _run(tmp_path, "torch==2.14.1")
    assert done.returncode == 0, done.stderr
    assert "[apbv] Collecting torch==2.14.1\n" in done.stderr
    assert "[apbv] Successfully installed torch==2.14.1\n" in done.stderr
    assert "Downloading" not in done.stderr and done.stdout == ""
    assert "Downloading torch==2.14.1.whl" in (tmp_path / ".venv" / "install.log").read_text()
    assert done.stderr.rstrip().endswith("[apbv] .venv ready")


def test_a_failed_install_fails(tmp_path: Path) -> None:
    done = _run(tmp_path, "broken")
    assert done.returncode == 1, done.stderr
    assert "[apbv] installation failed; full log in .venv/install.log" in done.stderr
    assert not (tmp_path / ".venv" / ".apbv-installed").exists()
