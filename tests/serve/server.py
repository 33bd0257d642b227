"""The real server as a subprocess for the serve tests: start, wait until ready, stop with
SIGINT and check that nothing of it is left (Ray's processes included)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _all_ready(health: dict[str, Any]) -> bool:
    return all(r["status"] == "ready" for r in health.get("replicas", [health]))


class ServerProcess:
    """``python -m apbv serve --config tiny_cpu --model MODEL --port P *flags`` on 127.0.0.1
    (``env``: variables added to its environment, e.g. ``APBV_SERVE_*`` settings)."""

    def __init__(self, model: Path, *flags: str, env: dict[str, str] | None = None):
        port = free_port()
        # Ray's authentication settings of the test process (or of a test that ran serve's
        # checks in it) are not the server's: it makes its own. Its settings are the test's.
        added = env or {}
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RAY_AUTH_", "APBV_SERVE_"))}
        env.update(added)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        cmd = [sys.executable, "-m", "apbv", "serve", "--config", "tiny_cpu", "--model",
               str(model), "--port", str(port), *flags]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()
        self.base = f"http://127.0.0.1:{port}"

    def tail(self) -> str:
        return "".join(self.log[-40:])

    def wait_ready(self, ready: Callable[[dict], bool] = _all_ready,
                   timeout_s: float = 90) -> None:
        """Until ``/health`` satisfies ``ready`` (every replica ready, by default)."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, "server exited:\n" + self.tail()
            assert time.monotonic() < deadline, "server not ready:\n" + self.tail()
            try:
                if ready(httpx.get(self.base + "/health").json()):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGINT: the server must exit 0 and take its whole process group with it."""
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            pytest.fail("the server did not stop on SIGINT:\n" + self.tail())
        assert self.proc.returncode == 0, self.tail()
        for _ in range(40):  # Ray's processes went with it
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.25)
        os.killpg(self.proc.pid, signal.SIGKILL)
        pytest.fail("processes of the server's group were left running")


@contextmanager
def serving(model: Path, *flags: str,
            env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A started server (the caller waits for it to be ready), stopped and checked on exit."""
    server = ServerProcess(model, *flags, env=env)
    try:
        yield server
    finally:
        server.stop()


def call(method: str, url: str, key: str, timeout: float, **kwargs: Any) -> httpx.Response:
    """One HTTP request to a test server with ``key`` as its bearer token."""
    return httpx.request(method, url, timeout=timeout, headers={"Authorization": f"Bearer {key}"},
                         **kwargs)


def refused(response: httpx.Response, status: int, text: str) -> None:
    """Assert ``response`` is an error of ``status`` whose message holds ``text``."""
    assert response.status_code == status, response.text
    assert text in response.json()["error"]["message"], response.text
