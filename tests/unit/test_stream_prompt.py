"""The families' live-stream prompts (apbv.model.stream_prompt): the header, the chunks (pushed
in any sizes) and the rest after the video join into the family's one-shot context on the same
frames, at the one-shot positions (InternVL3: ``FrameN`` numbered on from the frames before
each chunk, 1-D positions; Qwen2.5-VL: one run of video tokens, M-RoPE from the frames' times)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from apbv.model.internvl.prompt import InternVLStreamPrompt, internvl_prompt_ids
from apbv.model.qwen2_5_vl.prompt import QwenRules, QwenStreamPrompt
from apbv.model.stream_prompt import ChunkPlace
from apbv.positions import mrope_positions

QUESTION = "What happens?"


def _join(prompt, pushes: list[list[int]], seconds_per_patch: float,
          frames_per_patch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The context ids and positions a stream holds after ``pushes`` (temporal unit indexes
    per chunk), then the ids after the video."""
    header = len(prompt.header)
    ids = [prompt.header]
    positions = [torch.arange(header).expand(3, 1, -1)]
    fed = 0
    for patches in pushes:
        at = ChunkPlace(fed, patches, seconds_per_patch, header,
                        int(torch.cat(positions, dim=-1).max()) + 1)
        chunk, where = prompt.chunk(at)
        assert where.shape == (3, 1, len(chunk)), (where.shape, len(chunk))
        ids.append(chunk)
        positions.append(where)
        fed += frames_per_patch * len(patches)
    return torch.cat(ids + [prompt.after]), torch.cat(positions, dim=-1)


@pytest.fixture(scope="module")
def internvl_processor(tmp_path_factory: pytest.TempPathFactory):
    from apbv.model.internvl.tiny import _processor

    return _processor(tmp_path_factory.mktemp("internvl"))


@pytest.mark.parametrize("pushes", [[[0], [1], [2]], [[0, 1], [2]], [[0], [1, 2]], [[0, 1, 2]]])
def test_internvl_stream_prompt_is_the_one_shot_prompt(internvl_processor, pushes) -> None:
    prompt = InternVLStreamPrompt(internvl_processor)
    ids, positions = _join(prompt, pushes, 0.5, 1)
    want, _ = internvl_prompt_ids(internvl_processor, QUESTION, 3)
    assert ids.tolist() == want.tolist()
    held = len(ids) - len(prompt.after)
    assert torch.equal(positions, torch.arange(held).expand(3, 1, -1))
    text = internvl_processor.tokenizer.decode(ids)
    assert [text.count(f"Frame{i}: <img>") for i in (1, 2, 3, 4)] == [1, 1, 1, 0], text


def test_qwen_stream_prompt_is_the_one_shot_prompt(tiny_model_dir: Path) -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_model_dir, local_files_only=True)
    grid_hw, tokens_per_second, seconds = (4, 6), 2.0, 1.0
    prompt = QwenStreamPrompt(processor, (2, 3), tokens_per_second)
    ids, positions = _join(prompt, [[0], [1, 2]], seconds, 2)
    want, _ = QwenRules(processor).prompt(QUESTION, (3, *grid_hw))
    assert ids.tolist() == want.tolist()
    video_token = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    one_shot = mrope_positions(want, [(3, *grid_hw)], [seconds], video_token_id=video_token,
                               spatial_merge_size=2, tokens_per_second=tokens_per_second)
    assert torch.equal(positions, one_shot[..., :positions.shape[-1]])
