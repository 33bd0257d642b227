"""Shared fixtures: the tiny checkpoint and synthetic videos, written once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from apbv.config import RuntimeConfig, load_config
from apbv.serve.ranks.ray_cluster import ENVIRONMENT as RAY_ENVIRONMENT


@pytest.fixture(autouse=True)
def _ray_environment_restored():
    """A test that runs ``serve``'s start in this process (its refusals, with ``ray.init``
    replaced) leaves Ray's environment as it found it: a token or auth mode set there would
    reach the Ray cluster a later test starts in this process, whose ``ray`` read its settings
    at import."""
    saved = {name: os.environ.get(name) for name in RAY_ENVIRONMENT}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from apbv.model.qwen2_5_vl.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("model") / "tiny-qwen2.5-vl")


@pytest.fixture(scope="session")
def long_video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 s at 4 fps, 224x224: about 5.8k prompt tokens under the tiny_cpu preset."""
    from apbv.synthetic.videos import write_test_video

    return write_test_video(tmp_path_factory.mktemp("video") / "long.mp4", num_frames=160,
                            fps=4.0, width=224, height=224, seed=1)


@pytest.fixture(scope="session")
def short_video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 s at 4 fps, 112x112: 6 temporal patches at 2 fps."""
    from apbv.synthetic.videos import write_test_video

    return write_test_video(tmp_path_factory.mktemp("video") / "short.mp4", num_frames=24,
                            fps=4.0, width=112, height=112, seed=2)


@pytest.fixture(scope="session")
def tiny_config(tiny_model_dir: Path) -> RuntimeConfig:
    return load_config("tiny_cpu", [f"model.path={str(tiny_model_dir)!r}"])
