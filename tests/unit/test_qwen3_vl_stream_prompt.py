"""Qwen3-VL's live-stream prompt (apbv.model.qwen3_vl.prompt.Qwen3VLStreamPrompt): the header,
the chunks (pushed in any sizes, each temporal patch's ``<t seconds>`` from its frames' capture
times) and the rest after the video join into the one-shot prompt of a decoded-frame video of
the same frames (``DecodedVideo(frames, fps)``: frame i at i / fps, the stock processor's
timestamps), at the stock interleaved M-RoPE positions (``get_rope_index``, each temporal
patch its own one-frame grid)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from apbv.engine.stream_plan import unit_times
from apbv.model.qwen3_vl.prompt import Qwen3VLRules, Qwen3VLStreamPrompt
from apbv.model.stream_prompt import ChunkPlace
from apbv.video import DecodedVideo, Sampling

QUESTION = "What happens?"
FPS = 3.0
"""Patch times 0.2, 0.8, 1.5, 2.2 s: each stamp's text differs."""
HEIGHT, WIDTH = 64, 96
"""A frame's merged grid is 2 x 3: rows and columns advance the positions differently."""


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from apbv.model.qwen3_vl.adapter import Qwen3VL
    from apbv.model.qwen3_vl.tiny import build_tiny_qwen3_vl, tiny_processor

    processor = tiny_processor(tmp_path_factory.mktemp("qwen3-processor"))
    return Qwen3VL(model=build_tiny_qwen3_vl(), processor=processor)


def _join(prompt: Qwen3VLStreamPrompt, pushes: list[int],
          stamps: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The context ids a stream holds after pushes of ``pushes`` temporal patches (frames
    captured at ``stamps``), then the ids after the video; the positions of all but those."""
    header = len(prompt.header)
    ids, positions = [prompt.header], [torch.arange(header).expand(3, 1, -1)]
    first = 0
    for n in pushes:
        frames = stamps[2 * first:2 * (first + n)]
        at = ChunkPlace(2 * first, list(range(first, first + n)), 2 / FPS, header,
                        int(torch.cat(positions, dim=-1).max()) + 1,
                        seconds=unit_times(frames, stamps[0], 2))
        chunk, where = prompt.chunk(at)
        assert where.shape == (3, 1, len(chunk)), (where.shape, len(chunk))
        ids.append(chunk)
        positions.append(where)
        first += n
    return torch.cat(ids + [prompt.after]), torch.cat(positions, dim=-1)


@pytest.mark.parametrize("pushes", [[1, 1, 1, 1], [2, 2], [1, 3], [4]])
def test_qwen3_vl_stream_prompt_is_the_one_shot_prompt(qwen3: Any, pushes: list[int]) -> None:
    frames = torch.zeros(8, 3, HEIGHT, WIDTH, dtype=torch.uint8)
    video = DecodedVideo(frames, FPS, image_patch_size=16)
    sampling = dataclasses.replace(video.sampling, temporal_patch_size=2)
    grid = qwen3.video_grid(sampling)
    assert grid == (4, HEIGHT // 16, WIDTH // 16)
    want, _ = Qwen3VLRules(qwen3.processor).prompt(QUESTION, grid, sampling=sampling)
    prompt = qwen3.stream_prompt(grid[1:])
    ids, positions = _join(prompt, pushes, [i / FPS for i in range(len(frames))])
    assert ids.tolist() == want.tolist()
    text = qwen3.processor.tokenizer.decode(ids)
    assert [text.count(f"<{t} seconds>") for t in ("0.2", "0.8", "1.5", "2.2")] == [1] * 4
    one_shot = qwen3.positions(want, grid, 0.0)
    assert torch.equal(positions, one_shot[..., :positions.shape[-1]])


def test_stream_grid_is_in_the_processors_patches(qwen3: Any) -> None:
    """A stream's frames come as a sampling built without the family's patch size (the
    default 14): its grid is still in Qwen3-VL's 16-pixel patches (160x224: 10 x 14)."""
    sampling = Sampling((0, 1), FPS, 160, 224, temporal_patch_size=2)
    assert sampling.image_patch_size != 16
    assert qwen3.video_grid(sampling) == (1, 10, 14)
