"""A preset's relative ``model.path`` resolves from the preset's own directory when the
checkpoint is kept there, so ``--config /proj/run.toml`` works from any directory; otherwise it
stays relative to the current directory (the shipped ``tiny_cpu``'s ``.cache/...``)."""

from __future__ import annotations

from pathlib import Path

from apbv.config import load_config


def test_a_checkpoint_beside_its_preset(tmp_path: Path, monkeypatch) -> None:
    project = tmp_path / "project"
    (project / "ckpt").mkdir(parents=True)
    preset = project / "run.toml"
    preset.write_text('[model]\npath = "ckpt"\n')
    monkeypatch.chdir(tmp_path)  # elsewhere: "ckpt" is not here
    assert load_config(str(preset)).model.path == str((project / "ckpt").resolve())
    override = load_config(str(preset), ['model.path="other"'])
    assert override.model.path == "other"  # an override is the caller's, as given


def test_otherwise_relative_to_the_current_directory(tmp_path: Path, monkeypatch) -> None:
    preset = tmp_path / "run.toml"
    preset.write_text('[model]\npath = "missing-ckpt"\n')
    monkeypatch.chdir(tmp_path)
    assert load_config(str(preset)).model.path == "missing-ckpt"
    assert load_config("tiny_cpu").model.path == ".cache/tiny-qwen2.5-vl"
