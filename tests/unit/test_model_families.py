"""apbv.model.families: the family comes from config.json's model_type, and a checkpoint of a
family apbv does not run is refused before transformers is imported or any weight is read."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from apbv.model.families import FAMILIES, family_of, load_adapter

ROOT = Path(__file__).resolve().parents[2]
LLAVA_ONEVISION = {  # a tiny LLaVA-OneVision config.json (another family's shape)
    "architectures": ["LlavaOnevisionForConditionalGeneration"],
    "model_type": "llava_onevision", "image_token_index": 151646, "video_token_index": 151647,
    "text_config": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32,
                      "patch_size": 14, "image_size": 56},
}


def _llava_onevision(path: Path) -> Path:
    """A complete-looking tiny LLaVA-OneVision directory: config, weights, tokenizer and
    processor files (their contents never read)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(LLAVA_ONEVISION))
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "preprocessor_config.json"):
        (path / name).write_text("{}")
    return path


def test_family_of_the_tiny_checkpoint(tiny_model_dir: Path) -> None:
    assert family_of(tiny_model_dir) is FAMILIES["qwen2_5_vl"]
    assert FAMILIES["qwen2_5_vl"].name == "Qwen2.5-VL"


def test_another_family_is_refused_fast_naming_the_supported(tmp_path: Path) -> None:
    ckpt = _llava_onevision(tmp_path / "llava")
    start = time.perf_counter()
    with pytest.raises(ValueError) as info:
        load_adapter(ckpt, device=torch.device("cpu"), dtype=torch.float32)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"refused after {elapsed:.2f} s"
    message = str(info.value)
    assert "is a 'llava_onevision' checkpoint" in message, message
    for model_type, family in FAMILIES.items():
        assert f"{model_type!r} ({family.name})" in message, message


def test_the_refusal_imports_no_transformers(tmp_path: Path) -> None:
    """In a fresh interpreter: the refusal comes before transformers (and so any weight)."""
    ckpt = _llava_onevision(tmp_path / "llava")
    code = ("import sys, torch\n"
            "from apbv.model.families import load_adapter\n"
            "try:\n"
            f"    load_adapter({str(ckpt)!r}, device=torch.device('cpu'), dtype=torch.float32)\n"
            "except ValueError as exc:\n"
            "    print('refused:', exc)\n"
            "print('transformers' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("refused:") and "llava_onevision" in lines[0], result.stdout
    assert lines[-1] == "False", result.stdout


def test_the_engine_names_no_family_module() -> None:
    """apbv/engine/ loads through the registry: no engine module names a family's folder."""
    modules = {f.package for f in FAMILIES.values()}
    for source in sorted((ROOT / "apbv" / "engine").glob("*.py")):
        text = source.read_text(encoding="utf-8")
        for module in modules:
            assert module not in text, f"{source.name} names {module}"


def test_internvl_with_another_decoder_is_refused_before_loading(tmp_path: Path) -> None:
    """InternVL3 runs a qwen2 decoder: a checkpoint with another one (InternVL3.5's qwen3) is
    refused from its config alone, before any weight is read."""
    from apbv.model.internvl import adapter as internvl

    ckpt = _llava_onevision(tmp_path / "internvl35")
    config = {**LLAVA_ONEVISION, "model_type": "internvl",
              "text_config": {"model_type": "qwen3", "hidden_size": 64}}
    (ckpt / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    with pytest.raises(ValueError, match="has a 'qwen3' decoder; InternVL3 runs qwen2"):
        internvl.load(ckpt, device=torch.device("cpu"), dtype=torch.float32)
    assert time.perf_counter() - start < 1.0


def test_make_tiny_model_family_choices(tmp_path: Path, capsys) -> None:
    """``--family`` picks the writer; ``--size medium`` is Qwen2.5-VL's only, refused in one
    line before any model is built."""
    from apbv.__main__ import main

    out = tmp_path / "tiny"
    assert main(["make-tiny-model", "--family", "internvl", "--size", "medium",
                 "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "qwen2_5_vl" in lines[0] and "internvl" in lines[0], lines[0]
    assert not out.exists()
    with pytest.raises(SystemExit):
        main(["make-tiny-model", "--family", "llava_onevision", "--out", str(out)])
    assert "invalid choice: 'llava_onevision'" in capsys.readouterr().err


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_row_names_its_folders_parts(model_type: str) -> None:
    """A row's folder holds what the row names: the adapter's ``load``, the rules class the
    front end makes from the processor class the row names, and the tiny writer."""
    from apbv.model.front import prompt_rules

    family = FAMILIES[model_type]
    assert family.package == f"apbv.model.{model_type}", family
    assert callable(family.part("adapter", "load")) and callable(family.part("tiny", family.tiny))
    rules_class = family.part("prompt", family.rules)
    stand_in = type(family.processor, (), {})()  # a processor's class name is what picks
    assert type(prompt_rules(stand_in)) is rules_class
    with pytest.raises(ValueError, match=f"no prompt rules for a Other; supported: .*"
                                         f"{family.processor}"):
        prompt_rules(type("Other", (), {})())
