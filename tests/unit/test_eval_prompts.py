"""Each family's lmms-eval prompt (apbv.eval.prompts), as bytes: the task text after the video
(LongVideoBench: lmms-eval's ``longvideobench_doc_to_text`` with the val_v yaml's pre/post
prompts; VNBench: VideoNIAH's) and the system turn of the family's lmms-eval wrapper; for
InternVL3 the whole rendered prompt equals what lmms-eval's internvl3 wrapper sends through the
checkpoint's ``chat`` (``Frame{i}: <image>\\n`` lines, the internvl2_5 conversation template);
the harness passes the family's system text to the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apbv.eval.data import load_samples
from apbv.eval.harness import EvalSpec, run_sample
from apbv.eval.prompts import eval_prompt, family_prompt

INTERNVL_SYSTEM = ("\u4f60\u662f\u4e66\u751f\u00b7\u4e07\u8c61\uff0c\u82f1\u6587\u540d\u662f"
                   "InternVL\uff0c\u662f\u7531\u4e0a\u6d77\u4eba\u5de5\u667a\u80fd\u5b9e\u9a8c"
                   "\u5ba4\u3001\u6e05\u534e\u5927\u5b66\u53ca\u591a\u5bb6\u5408\u4f5c\u5355"
                   "\u4f4d\u8054\u5408\u5f00\u53d1\u7684\u591a\u6a21\u6001\u5927\u8bed\u8a00"
                   "\u6a21\u578b\u3002")
"""The internvl2_5 template's system message, written as code points."""
LVB_TEXT = ("Who opens the door?\nA. the cat\nB. 42\nC. nobody\n"
            "Answer with the option's letter from the given choices directly.\n")
VNB_TEXT = ("How many needles?\nA. 1\nB. 2\nC. 3\nD. 4\n"
            "Answer with the option's letter from the given choices directly.")


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("bench")
    (root / "videos").mkdir()
    (root / "lvb_val.json").write_text(json.dumps([{
        "id": "v1", "video_path": "a.mp4", "question": "Who opens the door?",
        "candidates": ["the cat", "42", "nobody"], "correct_choice": 0,
        "duration_group": 15, "question_category": "E2O"}]))
    (root / "VNBench-main-4try.json").write_text(json.dumps([{
        "video": "./VNBench/b.mp4", "question": "How many needles?", "options": [1, 2, 3, 4],
        "gt": 2, "type": "cnt_edit1", "try": 0}]))
    return {"longvideobench": load_samples("longvideobench", root)[0],
            "vnbench": load_samples("vnbench", root)[0]}


@pytest.mark.parametrize(("model_type", "system"), [
    ("qwen2_5_vl", None), ("qwen3_vl", "You are a helpful assistant."),
    ("internvl", INTERNVL_SYSTEM)])
def test_family_prompts_are_lmms_evals_bytes(samples: dict, model_type: str,
                                             system: str | None) -> None:
    assert eval_prompt(model_type, samples["longvideobench"]) == (system, LVB_TEXT)
    assert eval_prompt(model_type, samples["vnbench"]) == (system, VNB_TEXT)


def test_unknown_family_is_refused() -> None:
    with pytest.raises(ValueError, match="no lmms-eval prompt for model_type 'llava'; "
                                         "supported: qwen2_5_vl, internvl, qwen3_vl"):
        family_prompt("llava")
    with pytest.raises(ValueError, match="supported: qwen2_5_vl"):
        EvalSpec(bench="vnbench", data_dir=".", out="x.jsonl", model_type="llava")


def test_internvl_prompt_renders_as_lmms_evals_chat(samples: dict, tmp_path: Path) -> None:
    from apbv.model.internvl.prompt import internvl_prompt_ids
    from apbv.model.internvl.tiny import _processor

    processor = _processor(tmp_path)
    system, text = eval_prompt("internvl", samples["longvideobench"])
    context, query = internvl_prompt_ids(processor, text, 2, system)
    image = "<img>" + "<IMG_CONTEXT>" * 256 + "</img>"
    user = "".join(f"Frame{i + 1}: <image>\n" for i in range(2)) + text  # the wrapper's text
    want = (f"<|im_start|>system\n{INTERNVL_SYSTEM}<|im_end|>\n<|im_start|>user\n"
            f"{user.replace('<image>', image)}<|im_end|>\n<|im_start|>assistant\n")
    assert processor.tokenizer.decode(context.tolist() + query.tolist()) == want


def test_qwen2_5_vl_template_default_is_lmms_evals_system(tiny_model_dir: Path) -> None:
    from transformers import AutoProcessor

    from apbv.sequence import build_prompt

    processor = AutoProcessor.from_pretrained(tiny_model_dir, local_files_only=True)
    default = build_prompt(processor, LVB_TEXT, 4, None)
    explicit = build_prompt(processor, LVB_TEXT, 4, "You are a helpful assistant.")
    assert [t.tolist() for t in default] == [t.tolist() for t in explicit]


class _Recorder:
    """An engine stand-in that records each request's keyword arguments."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def request(self, video: str, question: str, **kwargs):
        self.calls.append({"question": question, **kwargs})
        return None

    def generate(self, request):
        raise ValueError("not run")


@pytest.mark.parametrize("model_type", ["internvl", "qwen3_vl", "qwen2_5_vl"])
def test_harness_sends_the_family_system(samples: dict, model_type: str) -> None:
    engine = _Recorder()
    spec = EvalSpec(bench="vnbench", data_dir=".", out="x.jsonl", model_type=model_type,
                    compare="exact")
    run_sample(engine, samples["vnbench"], spec)
    system = family_prompt(model_type).system
    assert engine.calls[0]["question"] == VNB_TEXT
    assert engine.calls[0].get("system") == system and ("system" in engine.calls[0]) == \
        (system is not None)
