"""What the InternVL3 and Qwen3-VL tests share: one :class:`Family` row per family (the tests
run over :data:`FAMILIES`), a module's tiny checkpoint of a family, and a stream test's answers
(greedy tokens and the choices' log-probabilities) and their check."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.cases import LOGPROB_RTOL, logprob_error


@dataclass(frozen=True)
class Family:
    """What the family tests need of a family beyond its ``model_type``."""

    tiny_dir: str
    """Its tiny checkpoint's directory name."""
    stream_hw: tuple[int, int]
    """A live stream's frame size (multiples of the family's frame multiple)."""
    stream_fps: float
    pushes: tuple[int, ...]
    """Frames per push before the first ask; then one push of 2 more."""
    window_kept: int
    """Frames a 1.5 s window over pushes of 2 frames keeps."""
    refused_hw: tuple[int, int]
    """A frame size a stream of the family refuses at open (a multiple of another family's
    frame multiple)."""
    frame_multiple: int
    """The family's: a stream's frame sides are multiples of it (pixels)."""
    patch: int
    """Its vision patch size (:class:`apbv.video.DecodedVideo`'s ``image_patch_size``)."""


FAMILIES = {
    "internvl": Family("tiny-internvl3", (56, 56), 2.0, (1, 2, 3), 4, (32, 32), 28, 14),
    "qwen3_vl": Family("tiny-qwen3-vl", (64, 96), 3.0, (2, 3, 5), 6, (56, 56), 32, 16),
}
"""``model_type`` -> :class:`Family`. InternVL3: each frame its own temporal unit, 2 fps;
Qwen3-VL: pushes of 2, 3 and 5 frames (the odd frame waits for the next push) make chunks of
1, 1 and 3 temporal patches, at 3 fps so that the patches' times (0.2, 0.8, 1.5, 2.2, 2.8 s,
...) each have their own ``<t seconds>`` text."""

TINY_DIRS = {family: row.tiny_dir for family, row in FAMILIES.items()}
"""Each family's tiny checkpoint directory name."""


def tiny_dir(factory: pytest.TempPathFactory, family: str) -> Path:
    """``family``'s tiny checkpoint (``make-tiny-model --family``) in a new temporary
    directory."""
    from apbv.model.families import write_tiny_family

    return write_tiny_family(family, factory.mktemp("model") / TINY_DIRS[family])


def tiny_config(factory: pytest.TempPathFactory, family: str) -> Any:
    """The ``tiny_cpu`` runtime config over :func:`tiny_dir`."""
    from apbv.config import load_config

    return load_config("tiny_cpu", [f"model.path={str(tiny_dir(factory, family))!r}"])


def answers(engine: Any, video: Any, question: str, choices: tuple[str, ...],
            new_tokens: int, with_choices: bool = True) -> tuple[list[int], list[float]]:
    """Greedy tokens (``new_tokens``) and, ``with_choices``, the log-probabilities of
    ``choices``, exact mode, for ``video`` (decoded frames or a stream)."""
    from apbv.engine.request import Request

    said = engine.generate(Request(video=video, question=question, mode="exact",
                                   max_new_tokens=new_tokens))
    if not with_choices:
        return said.token_ids, []
    scored = engine.generate(Request(video=video, question=question, mode="exact",
                                     choices=choices))
    assert scored.choices is not None
    return said.token_ids, [c["logprob"] for c in scored.choices]


def check_same(got: tuple[list[int], list[float]], want: tuple[list[int], list[float]],
               what: str) -> None:
    """:func:`answers` over a stream (``got``) equal the one-shot ones (``want``): the same
    tokens, and log-probabilities within :data:`tests.cases.LOGPROB_RTOL`."""
    assert got[0] == want[0], (what, got[0], want[0])
    errors = [logprob_error(a, b) for a, b in zip(got[1], want[1], strict=True)]
    assert len(errors) == len(want[1])
    assert max(errors, default=0.0) <= LOGPROB_RTOL, (
        f"{what}: choice log-probabilities over the stream vs one-shot: max relative err "
        f"{max(errors):.2e} > {LOGPROB_RTOL:g}; {got[1]} vs {want[1]}")


def stock_internvl(directory: Path, question: str) -> tuple[Any, Any, str]:
    """transformers alone on an InternVL3 checkpoint: the stock processor, the model (SDPA,
    eval mode) and the chat text asking ``question`` about one video."""
    from transformers import AutoProcessor, InternVLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(directory, local_files_only=True)
    hf = InternVLForConditionalGeneration.from_pretrained(
        directory, local_files_only=True, attn_implementation="sdpa").eval()
    messages = [{"role": "user", "content": [{"type": "video"},
                                             {"type": "text", "text": question}]}]
    return processor, hf, processor.apply_chat_template(messages, add_generation_prompt=True)


def stock_internvl_file(directory: Path, video: Path, question: str,
                        num_frames: int) -> tuple[Any, Any]:
    """:func:`stock_internvl`'s model and its inputs for ``question`` about the video file:
    every frame decoded, the stock processor's own choice of ``num_frames`` and resize."""
    import decord
    import torch

    processor, hf, text = stock_internvl(directory, question)
    reader = decord.VideoReader(str(video))
    frames = torch.from_numpy(reader.get_batch(list(range(len(reader)))).asnumpy())
    inputs = processor(text=[text], videos=[frames.permute(0, 3, 1, 2)], return_tensors="pt",
                       do_sample_frames=True, num_frames=num_frames)
    return hf, inputs
