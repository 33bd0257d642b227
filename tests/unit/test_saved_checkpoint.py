"""A checkpoint written by the installed transformers' ``save_pretrained`` passes the checkpoint
check, loads, and answers as the checkpoint it was saved from; what transformers cannot load is
still refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from apbv.__main__ import main
from apbv.model.checkpoint import validate_checkpoint
from apbv.model.families import SUPPORTED
from tests.saved_checkpoint import save_with_transformers


@pytest.fixture(scope="module")
def saved_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_with_transformers(tiny_model_dir, tmp_path_factory.mktemp("saved") / "fine-tune")


def test_saved_checkpoint_passes_the_check_and_loads(saved_dir: Path,
                                                     tiny_model_dir: Path) -> None:
    import transformers

    from apbv.model.qwen2_5_vl.adapter import load

    names = {p.name for p in saved_dir.iterdir()}
    if transformers.__version__.startswith("5."):  # what made the check refuse it
        assert "processor_config.json" in names and "preprocessor_config.json" not in names
    assert validate_checkpoint(saved_dir, SUPPORTED) == saved_dir
    saved = load(saved_dir, device=torch.device("cpu"), dtype=torch.float32)
    source = load(tiny_model_dir, device=torch.device("cpu"), dtype=torch.float32)
    for (name, a), (_, b) in zip(saved.model.state_dict().items(),
                                 source.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert saved.processor.video_processor.to_dict()["merge_size"] == 2


def test_generate_answers_as_the_source_checkpoint(capsys, saved_dir: Path,
                                                   tiny_model_dir: Path,
                                                   short_video: Path) -> None:
    answers = []
    for model, system in ((saved_dir, []), (tiny_model_dir, []), (saved_dir, ["--system",
                                                                             "Be brief."])):
        assert main(["generate", "--config", "tiny_cpu", "--model", str(model), "--video",
                     str(short_video), "--question", "What is shown?", "--max-new-tokens", "4",
                     "--json", *system]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        answers.append((out["token_ids"], out["context_len"], out["query_len"]))
    assert answers[0] == answers[1] and len(answers[0][0]) == 4
    # --system replaces the template's default system turn ("You are a helpful assistant.":
    # 6 tokens; "Be brief.": 3).
    assert answers[2][1] == answers[0][1] - 3 and answers[2][2] == answers[0][2]


def test_processor_settings_missing_are_still_refused(saved_dir: Path, tmp_path: Path) -> None:
    """A processor_config.json without the image or video processor (what 4.x wrote next to
    the per-part files) does not stand for them."""
    ckpt = Path(shutil.copytree(saved_dir, tmp_path / "ckpt"))
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        (ckpt / name).unlink(missing_ok=True)
    (ckpt / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Qwen2_5_VLProcessor"}))
    with pytest.raises(ValueError, match="lacks the tokenizer/processor files: "
                                         "preprocessor_config.json .or a processor_config"):
        validate_checkpoint(ckpt, SUPPORTED)
    (ckpt / "processor_config.json").unlink()
    with pytest.raises(ValueError, match="preprocessor_config.json"):
        validate_checkpoint(ckpt, SUPPORTED)
    (ckpt / "video_preprocessor_config.json").write_text("{}")  # 4.x's per-part file
    assert validate_checkpoint(ckpt, SUPPORTED) == ckpt
