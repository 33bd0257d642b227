"""One model naming across ``plan --preset`` and the configs: the configs' spelling of a model
(``qwen2_5_vl_7b``, or a config's own name) is accepted by ``plan --preset`` with a note."""

from __future__ import annotations

import pytest

from apbv import cost
from apbv.__main__ import main


@pytest.mark.parametrize("name, expected", [
    ("qwen2.5-vl-7b", "qwen2.5-vl-7b"), ("qwen2_5_vl_7b", "qwen2.5-vl-7b"),
    ("qwen2_5_vl_7b_8gpu", "qwen2.5-vl-7b"), ("Qwen2_5_VL_3B_8gpu", "qwen2.5-vl-3b"),
])
def test_either_spelling_names_the_preset(name: str, expected: str) -> None:
    assert cost.preset_name(name) == expected
    assert cost.preset_dims(name) == cost.MODEL_PRESETS[expected]


def test_an_unknown_model_names_both_spellings() -> None:
    with pytest.raises(ValueError, match="allowed: qwen2.5-vl-3b, qwen2.5-vl-7b, .*qwen2_5_vl"):
        cost.preset_name("qwen2_5_vl_72b")


def test_plan_takes_the_config_spelling_with_a_note(capsys) -> None:
    assert main(["plan", "--preset", "qwen2_5_vl_7b_8gpu", "--context-len", "4096"]) == 0
    out = capsys.readouterr()
    assert "note: model preset 'qwen2_5_vl_7b_8gpu' read as 'qwen2.5-vl-7b'" in out.err
    assert "context N=4096" in out.out
