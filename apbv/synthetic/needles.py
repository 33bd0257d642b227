"""Synthetic needle-in-a-haystack videos with questions and answers (VNBench's three kinds).

A video is a run of temporal patches (2 identical frames each, ``FRAME_SIZE`` pixels square):
most are *distractors* (uniform colour noise: content, not blank, whose mean colour is grey),
a few are *needles* (the frame filled with one named colour, plus a little noise). The kinds:

- ``retrieval``: one needle; "What colour is the flash?" -> its colour.
- ``ordering``: two needles of different colours; "What colour is the first of the two
  flashes?" -> the earlier one's colour.
- ``counting``: 1 .. ``MAX_COUNT`` needles (random colours); "How many flashes are there?" ->
  the number as a digit.
- ``presence``: no needle or 1 .. ``MAX_COUNT`` (random colours), each half of the time; "Is
  there a flash?" -> ``yes`` / ``no`` (the standing question a watch asks of a stream).
- ``recent``: 2 .. ``MAX_COUNT`` needles of different colours; "What colour is the most recent
  flash?" -> the last one's colour.

Answers are one short word, so a model answers with a few greedy tokens and a closed
vocabulary (:func:`answer_choices`) scores them exactly. A sample is a pure function of
``(seed, kind, index, patches, depth)``: the trainer, the fidelity benchmark and the tests draw
disjoint seeds from the same generator. With ``FRAME_SIZE`` 56 a patch is 4 LLM tokens, so a
prompt of ``L`` tokens holds about ``(L - PROMPT_OVERHEAD) / 4`` patches
(:func:`patches_for_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

KINDS = ("retrieval", "ordering", "counting", "presence", "recent")
"""Task kinds; a kind's place here seeds its samples, so new kinds go at the end."""
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 30, 30), "green": (30, 200, 40), "blue": (30, 60, 230),
    "yellow": (235, 220, 30), "cyan": (30, 215, 225), "magenta": (220, 40, 210),
    "white": (245, 245, 245), "black": (12, 12, 12),
}
QUESTIONS = {
    "retrieval": "What colour is the flash?",
    "ordering": "What colour is the first of the two flashes?",
    "counting": "How many flashes are there?",
    "presence": "Is there a flash?",
    "recent": "What colour is the most recent flash?",
}
PRESENCE_ANSWERS = ("yes", "no")
MAX_COUNT = 4
FRAME_SIZE = 56
"""Side of a frame in pixels: 2 x 2 merged patches, 4 LLM tokens per temporal patch."""
TOKENS_PER_PATCH = (FRAME_SIZE // 28) ** 2
FPS = 2.0
"""Frames per second: one temporal patch per second of video."""
PROMPT_OVERHEAD = 96
"""Text tokens of a prompt around the video, rounded up (system turn, question, headers)."""
NEEDLE_NOISE = 12
"""Half-width of the uniform noise added to a needle's colour."""


@dataclass(frozen=True)
class NeedleSample:
    kind: str
    question: str
    answer: str
    frames: torch.Tensor
    """uint8 (2 * patches, 3, FRAME_SIZE, FRAME_SIZE)."""
    needles: tuple[tuple[int, str], ...]
    """(temporal patch, colour) of each needle, in time order."""
    fps: float = FPS

    @property
    def patches(self) -> int:
        return self.frames.shape[0] // 2

    def video(self):  # -> apbv.video.DecodedVideo (imported lazily: torchvision, decoders)
        from apbv.video import DecodedVideo

        return DecodedVideo(frames=self.frames, fps=self.fps)


def answer_choices(kind: str) -> tuple[str, ...]:
    """Every answer a question of ``kind`` can have."""
    _check_kind(kind)
    if kind == "counting":
        return tuple(str(n) for n in range(1, MAX_COUNT + 1))
    if kind == "presence":
        return PRESENCE_ANSWERS
    return tuple(COLOURS)


def patches_for_tokens(tokens: int) -> int:
    """Temporal patches whose prompt is about ``tokens`` tokens long (at least 2 * MAX_COUNT)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive integer, got {tokens!r}")
    return max(2 * MAX_COUNT, (tokens - PROMPT_OVERHEAD) // TOKENS_PER_PATCH)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown task kind {kind!r}; allowed: {', '.join(KINDS)}")


def _needle_slots(rng: np.random.Generator, patches: int, count: int,
                  depth: float | None) -> list[int]:
    """``count`` distinct patch indices; with ``depth`` the first needle sits at that fraction
    of the video and the rest after it (ordering and counting spread over the remainder)."""
    if count == 0:
        return []
    if depth is None:
        return sorted(int(x) for x in rng.choice(patches, size=count, replace=False))
    first = min(int(depth * patches), patches - count)
    rest = rng.choice(np.arange(first + 1, patches), size=count - 1, replace=False)
    return sorted([first, *(int(x) for x in rest)])


def _check_args(kind: str, patches: int, depth: float | None) -> None:
    _check_kind(kind)
    if isinstance(patches, bool) or not isinstance(patches, int) or patches < 2 * MAX_COUNT:
        raise ValueError(f"patches must be an integer >= {2 * MAX_COUNT}, got {patches!r}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")


def _draw_needles(kind: str, *, patches: int, seed: int, index: int, depth: float | None
                  ) -> tuple[np.random.Generator, list[tuple[int, str]], str]:
    """The sample's generator (its noise still to draw), its (patch, colour) needles in time
    order and its answer: the part of :func:`make_sample` that decides the answer."""
    rng = np.random.default_rng([seed, KINDS.index(kind), index, patches])
    names = list(COLOURS)
    if kind == "retrieval":
        colours = [names[rng.integers(len(names))]]
    elif kind == "ordering":
        colours = [names[i] for i in rng.choice(len(names), size=2, replace=False)]
    elif kind == "counting":
        count = int(rng.integers(1, MAX_COUNT + 1))
        colours = [names[i] for i in rng.integers(len(names), size=count)]
    elif kind == "presence":
        count = int(rng.integers(1, MAX_COUNT + 1)) if rng.integers(2) else 0
        colours = [names[i] for i in rng.integers(len(names), size=count)]
    else:  # recent
        count = int(rng.integers(2, MAX_COUNT + 1))
        colours = [names[i] for i in rng.choice(len(names), size=count, replace=False)]
    slots = _needle_slots(rng, patches, len(colours), depth)
    if kind == "counting":
        answer = str(len(colours))
    elif kind == "presence":
        answer = PRESENCE_ANSWERS[0] if colours else PRESENCE_ANSWERS[1]
    elif kind == "recent":
        answer = colours[-1]
    else:
        answer = colours[0]
    return rng, list(zip(slots, colours)), answer


def answer_of(kind: str, *, patches: int, seed: int, index: int,
              depth: float | None = None) -> str:
    """The answer of :func:`make_sample` with the same arguments, without drawing its frames
    (cheap: for picking held-out samples of a given answer)."""
    _check_args(kind, patches, depth)
    return _draw_needles(kind, patches=patches, seed=seed, index=index, depth=depth)[2]


def make_sample(kind: str, *, patches: int, seed: int, index: int,
                depth: float | None = None) -> NeedleSample:
    """Sample ``index`` of ``kind`` with ``patches`` temporal patches, from ``seed``.

    ``depth`` in [0, 1] places the (first) needle at that fraction of the video; None draws it
    uniformly. The same arguments always give the same frames, question and answer.
    """
    _check_args(kind, patches, depth)
    rng, needles, answer = _draw_needles(kind, patches=patches, seed=seed, index=index,
                                         depth=depth)
    size = FRAME_SIZE
    video = rng.integers(0, 256, size=(patches, size, size, 3), dtype=np.uint8)
    for slot, name in needles:
        noise = rng.integers(-NEEDLE_NOISE, NEEDLE_NOISE + 1, size=(size, size, 3))
        video[slot] = np.clip(np.array(COLOURS[name]) + noise, 0, 255).astype(np.uint8)
    frames = torch.from_numpy(video).permute(0, 3, 1, 2).repeat_interleave(2, dim=0)
    return NeedleSample(kind=kind, question=QUESTIONS[kind], answer=answer,
                        frames=frames.contiguous(), needles=tuple(needles))
