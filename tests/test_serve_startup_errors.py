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
