"""The ``apbv`` command starts quickly: ``--help`` and ``--version`` import nothing heavy (torch,
transformers, ray, fastapi), each subcommand imports what it needs when it runs; ``--version``
is the package's version."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import apbv

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
HEAVY = ("torch", "transformers", "ray", "fastapi", "uvicorn", "numpy")

# Runs the console script's entry point as pip's wrapper would (sys.argv[0] ends in "apbv"),
# then reports which heavy modules were imported.
CONSOLE_SCRIPT = """
import importlib, json, sys
module, func = sys.argv[1].split(":")
heavy, args = json.loads(sys.argv[2]), sys.argv[3:]
sys.argv = ["/venv/bin/apbv", *args]
try:
    status = getattr(importlib.import_module(module), func)(args)
except SystemExit as exc:
    status = exc.code
print(json.dumps({"status": status, "heavy": [m for m in heavy if m in sys.modules]}))
"""


def _run_console_script(*args: str) -> tuple[dict, str]:
    entry = PYPROJECT["project"]["scripts"]["apbv"]
    command = [sys.executable, "-c", CONSOLE_SCRIPT, entry, json.dumps(HEAVY), *args]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    *text, report = result.stdout.strip().splitlines()
    return json.loads(report), "\n".join(text)


def test_help_imports_nothing_heavy() -> None:
    report, text = _run_console_script("--help")
    assert report == {"status": 0, "heavy": []}
    assert text.startswith("usage: apbv ") and "make-test-video" in text and "--version" in text


def test_subcommand_help_imports_nothing_heavy() -> None:
    for command in ("serve", "generate", "plan"):
        report, text = _run_console_script(command, "--help")
        assert report == {"status": 0, "heavy": []}, command
        assert text.startswith(f"usage: apbv {command} "), text[:200]


def test_version_is_the_package_version() -> None:
    report, text = _run_console_script("--version")
    assert report == {"status": 0, "heavy": []}
    assert text == f"apbv {metadata.version('apbv')}"
    assert apbv.__version__ == PYPROJECT["project"]["version"] == apbv.package_version()


def test_python_m_apbv_help() -> None:
    result = subprocess.run([sys.executable, "-m", "apbv", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("usage: python -m apbv ")


def test_public_names_still_import() -> None:
    from apbv import MODES, Plan, apbv_attention, get_mode, make_plan

    assert callable(apbv_attention) and callable(make_plan) and get_mode("spava") in MODES.values()
    assert isinstance(make_plan(1000, 9, 3), Plan)
    assert set(apbv.__all__) <= set(dir(apbv))


def test_version_without_installed_metadata(monkeypatch) -> None:
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert apbv.package_version() == apbv.__version__
