"""``--config`` takes a model spelled as ``plan --preset`` spells it (``qwen2.5-vl-7b``) with
a note, so the two spellings work both ways (``plan --preset qwen2_5_vl_7b_8gpu`` is in
tests/unit/test_model_naming.py)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from apbv.cli.common import add_config_args, config_from_args, config_name
from apbv.config import load_config


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_args(parser, "tiny_cpu")
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("name, preset", [
    ("qwen2.5-vl-7b", "qwen2_5_vl_7b_8gpu"), ("Qwen2.5-VL-3B", "qwen2_5_vl_3b_8gpu"),
    ("qwen2_5_vl_7b", "qwen2_5_vl_7b_8gpu"),
])
def test_the_plan_spelling_reads_as_the_configs_with_a_note(name: str, preset: str, capsys):
    cfg = config_from_args(_args("--config", name, "--set", "attention.passing_len=64"))
    assert dataclasses.asdict(cfg) == dataclasses.asdict(
        load_config(preset, ["attention.passing_len=64"]))
    assert f"note: --config {name!r} read as {preset!r}" in capsys.readouterr().err


def test_a_preset_or_path_is_taken_as_it_is(tmp_path, capsys):
    assert config_name("tiny_cpu") == "tiny_cpu" and config_name(None) is None
    toml = tmp_path / "qwen2.5-vl-7b.toml"
    toml.write_text("[attention]\npassing_len = 32\n")
    assert config_from_args(_args("--config", str(toml))).attention.passing_len == 32
    assert capsys.readouterr().err == ""


def test_a_model_no_preset_has_is_refused_naming_the_presets():
    with pytest.raises(ValueError, match="config 'qwen2.5-vl-72b' not found; presets: .*"
                                         "qwen2_5_vl_7b_8gpu"):
        config_from_args(_args("--config", "qwen2.5-vl-72b"))
