"""``serve`` refuses a missing --media-root and a busy --port with one ``error:`` line naming
it, before Ray or the model start (Ray's ``init`` is replaced by a failure here)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from apbv.__main__ import main

ray = pytest.importorskip("ray")


@pytest.fixture
def no_ray_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def init(*args, **kwargs):
        raise AssertionError("Ray was started before the flags were checked")

    monkeypatch.setattr(ray, "init", init)


def _serve(capsys, model: Path, *flags: str) -> str:
    start = time.perf_counter()
    assert main(["serve", "--config", "tiny_cpu", "--model", str(model), *flags]) == 2
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert elapsed < 10, f"the refusal took {elapsed:.1f} s"  # the imports; no Ray, no model
    return err[0]


@pytest.mark.usefixtures("no_ray_start")
def test_missing_media_root_is_refused(capsys, tiny_model_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    assert _serve(capsys, tiny_model_dir, "--media-root", str(tmp_path), "--media-root",
                  str(missing)) == f"error: --media-root {str(missing)!r} does not exist"
    a_file = tmp_path / "clip.mp4"
    a_file.write_bytes(b"")
    assert _serve(capsys, tiny_model_dir, "--media-root", str(a_file)) == \
        f"error: --media-root {str(a_file)!r} is not a directory"


@pytest.mark.usefixtures("no_ray_start")
def test_busy_port_is_refused(capsys, tiny_model_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = _serve(capsys, tiny_model_dir, "--host", "127.0.0.1", "--port", str(port))
    assert line.startswith(f"error: --port {port} cannot be bound on 127.0.0.1 (--host "
                           "127.0.0.1): "), line
    assert "in use" in line, line
    assert _serve(capsys, tiny_model_dir, "--port", "70000") == \
        "error: --port must be an integer in 0 .. 65535, got 70000"


@pytest.mark.usefixtures("no_ray_start")
def test_config_file_and_environment_reach_the_checks(capsys, tiny_model_dir: Path,
                                                      tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve --config-file``: the file's busy port is overridden by APBV_SERVE_PORT (else
    the port check would refuse first), and its read_timeout_s = -1 is what is refused."""
    with socket.socket() as busy, socket.socket() as free:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        busy_port = busy.getsockname()[1]
        free.bind(("127.0.0.1", 0))
        free_port = free.getsockname()[1]
        free.close()
        file = tmp_path / "serve.toml"
        file.write_text(f'host = "127.0.0.1"\nport = {busy_port}\nread_timeout_s = -1\n')
        monkeypatch.setenv("APBV_SERVE_PORT", str(free_port))
        assert _serve(capsys, tiny_model_dir, "--config-file", str(file)) == \
            "error: --read-timeout-s must be > 0, got -1.0"
        monkeypatch.delenv("APBV_SERVE_PORT")
        line = _serve(capsys, tiny_model_dir, "--config-file", str(file))
    assert line.startswith(f"error: --port {busy_port} cannot be bound"), line
