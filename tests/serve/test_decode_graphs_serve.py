"""apbv serve refuses decode.graphs=on where its ranks could not capture a decode step (CPU
ranks; gloo between ranks sharing a GPU) before Ray starts, and accepts auto there."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")


def _run(monkeypatch: pytest.MonkeyPatch, flags: list[str]) -> None:
    from apbv.config import load_config
    from apbv.serve import main

    p = argparse.ArgumentParser()
    main.add_serve_args(p)
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args(flags)

    def started(*_: object, **__: object) -> None:
        raise RuntimeError("Ray started")

    monkeypatch.setattr(ray, "init", started)
    main.run_server(load_config("tiny_cpu", args.set), args)


@pytest.mark.parametrize("flags, message", [
    (["--gpus-per-rank", "0"], "the ranks run on cpu"),
    (["--gpus-per-rank", "0.5", "--world-size", "2"], "gloo collectives cannot be captured"),
])
def test_decode_graphs_on_is_refused_before_ray_starts(monkeypatch: pytest.MonkeyPatch,
                                                       flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=f"decode.graphs=on needs CUDA ranks.*{message}"):
        _run(monkeypatch, [*flags, "--set", "decode.graphs=on"])


def test_auto_goes_on_to_start_ray(monkeypatch: pytest.MonkeyPatch,
                                   tiny_model_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="Ray started"):
        _run(monkeypatch, ["--gpus-per-rank", "0", "--port", "0",
                           "--set", f"model.path={str(tiny_model_dir)!r}"])
