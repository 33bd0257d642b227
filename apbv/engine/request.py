"""A request, resolved once at the engine boundary, and its result.

Every client (the CLI, the demo, benchmarks, evaluation, the server) builds one :class:`Request`
and hands the same object to the engine on every rank. Building it resolves and validates what
the user wrote: the mode name becomes its :class:`apbv.modes.Mode`, the video settings become a
:class:`apbv.video.VideoSpec`, numbers are checked. The ranks then compare
:meth:`Request.fingerprint` before any model collective, so ranks given different requests fail
naming the field instead of mixing inputs.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from apbv.engine.sampling import GREEDY, Sampling
from apbv.modes import Mode, get_mode
from apbv.plan import Plan, Range
from apbv.validate import check_int, pruning_settings
from apbv.video import DecodedVideo, VideoSpec

if TYPE_CHECKING:
    from apbv.config import RuntimeConfig

MAX_QUESTION_CHARS = 32768
"""Longest question (and system text) accepted (characters); longer text is refused naming this
limit."""
MIN_CHOICES, MAX_CHOICES = 2, 64
"""How many closed-vocabulary choices a request may hold."""
MAX_CHOICE_CHARS = 256
"""Longest choice accepted (characters)."""
MAX_ANSWERS = 8
"""Answers one request may ask for (``n``), decoded one after another from one prefill."""
MAX_STOP_TEXTS, MAX_STOP_CHARS = 4, 64
"""How many stop texts a request may hold (OpenAI's limit), and how long each may be."""


class RequestCancelled(RuntimeError):
    """The caller's ``stop`` ended the request before its first token (raised on every rank
    at the same agreement point: after preprocessing, or after the vision tower)."""


@dataclass(frozen=True)
class StreamRef:
    """A live stream the engine holds (:meth:`apbv.engine.engine.Engine.open_stream`), as the
    video of a question about the frames appended so far."""

    stream_id: str
    fresh: bool = False
    """False: exact attention of the question over the stream's held KV (the request's mode
    must be ``exact``); True: a one-shot prefill of the held window in the request's mode, from
    the chunks' kept vision embeddings (the stream was opened with ``keep_vision``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.stream_id, str) or not self.stream_id:
            raise ValueError(f"a stream id must be a non-empty string, got {self.stream_id!r}")
        if not isinstance(self.fresh, bool):
            raise ValueError(f"fresh must be true or false, got {self.fresh!r}")


@dataclass(frozen=True)
class Request:
    """One question about one video, with every setting that decides the answer."""

    video: VideoSpec | DecodedVideo | StreamRef
    """The video file and how to sample it (fps or nframes, pixel budgets, decoder), frames
    already decoded and resized with their fps, or a live stream the engine holds."""
    question: str
    """Plain text: special-token strings in it are text, never control tokens."""
    mode: Mode
    max_new_tokens: int = 1
    """Greedy tokens to generate at most (the first one included)."""
    anchor_len: int | None = None
    """Anchor tokens A (None: the mode's default)."""
    passing_len: int | None = None
    """Passed tokens per block P (None: the mode's default)."""
    kernel: str | None = None
    """Attention kernel backend (None: the best available)."""
    choices: tuple[str, ...] | None = None
    """Closed-vocabulary answers: score each (plain text) by its exact log-probability after
    the prompt instead of generating; None: greedy generation."""
    stop_texts: tuple[str, ...] = ()
    """Texts that end a generated answer (OpenAI's ``stop``): decoding stops once the
    answer's text holds one, and the answer is cut before it."""
    system: str | None = None
    """The system turn's text (a chat request's system message), plain text like the question;
    None: the chat template's default system turn."""
    sampling: Sampling = GREEDY
    """How each generated token is picked (greedy by default: evaluation and closed
    vocabularies always are) and whether its log-probabilities are reported."""
    static_threshold: float = 0.0
    """Temporal pruning of a video file or decoded frames (``video.static_threshold``, colour
    levels; 0: off): temporal patches that changed less than this since the last kept one are
    not encoded nor prompted (:mod:`apbv.video.prune`; a live stream's chunks are not pruned)."""
    pruning_rate: float = 0.0
    """``video.pruning_rate`` (vLLM's ``video_pruning_rate``, in [0, 1); 0: off): the fraction
    of the video's tokens (after ``static_threshold``'s patches) that changed least, dropped
    after the tower; the first patch stays whole (:mod:`apbv.video.prune`; not for streams)."""
    n: int = 1
    """Answers to generate (1 .. :data:`MAX_ANSWERS`), each decoded from the same prefilled
    KV; answer i samples with :meth:`Sampling.for_answer` (the first is the n=1 answer)."""

    def __post_init__(self) -> None:
        if isinstance(self.mode, str):  # resolve a mode name once, here
            object.__setattr__(self, "mode", get_mode(self.mode))
        if not isinstance(self.question, str) or not self.question.strip():
            raise ValueError("the question must be a non-empty string")
        if len(self.question) > MAX_QUESTION_CHARS:
            raise ValueError(f"the question has {len(self.question)} characters; the limit is "
                             f"{MAX_QUESTION_CHARS}")
        check_int("max_new_tokens", self.max_new_tokens, 1)
        check_int("n", self.n, 1)
        if self.n > MAX_ANSWERS or (self.n > 1 and self.choices is not None):
            raise ValueError(f"n must be 1 .. {MAX_ANSWERS}, got {self.n}" if
                             self.n > MAX_ANSWERS else "n > 1 does not go with choices: "
                             "the choices are scored once, exactly")
        for name in ("anchor_len", "passing_len"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 0)
        if self.choices is not None:
            object.__setattr__(self, "choices", check_choices(self.choices))
        object.__setattr__(self, "stop_texts", check_stop_texts(self.stop_texts, self.choices))
        if not isinstance(self.sampling, Sampling):
            raise ValueError(f"sampling must be a Sampling, got {type(self.sampling).__name__}")
        if self.choices is not None and self.sampling != GREEDY:
            raise ValueError("a request with choices scores them exactly; it samples nothing "
                             "and reports no per-token logprobs: leave temperature at 0 and "
                             "logprobs unset, without penalties, logit_bias, min_tokens or "
                             "structured output")
        pruning_settings(self.pruning_rate, self.static_threshold)
        if self.system is not None and not isinstance(self.system, str):
            raise ValueError(f"the system text must be a string or None, got "
                             f"{type(self.system).__name__}")
        if self.system is not None and len(self.system) > MAX_QUESTION_CHARS:
            raise ValueError(f"the system text has {len(self.system)} characters; the limit is "
                             f"{MAX_QUESTION_CHARS}")

    @classmethod
    def from_config(
        cls, cfg: RuntimeConfig, video: str | StreamRef, question: str, *,
        mode: str | None = None,
        max_new_tokens: int | None = None, choices: Sequence[str] | None = None,
        stop_texts: str | Sequence[str] = (), system: str | None = None,
    ) -> Request:
        """The request the config describes for ``video`` (a file, sampled as the config says,
        or a live stream) and ``question``; ``mode`` and
        ``max_new_tokens`` replace the config's when given; ``choices`` makes it a
        closed-vocabulary request; ``stop_texts`` end a generated answer; ``system`` is the
        system turn's text."""
        att = cfg.attention
        return cls(
            video=video if isinstance(video, StreamRef) else cfg.video.spec(video),
            question=question,
            mode=get_mode(att.mode if mode is None else mode),
            max_new_tokens=cfg.generate.max_new_tokens if max_new_tokens is None
            else max_new_tokens,
            anchor_len=att.anchor_len,
            passing_len=att.passing_len,
            kernel=att.kernel,
            choices=choices,  # type: ignore[arg-type]  # checked and made a tuple on init
            stop_texts=stop_texts,  # type: ignore[arg-type]  # the same
            system=system,
            static_threshold=cfg.video.static_threshold,
            pruning_rate=cfg.video.pruning_rate,
        )

    def plan(self, context_len: int, query_len: int, world_size: int) -> Plan:
        return self.mode.plan(context_len, query_len, world_size, anchor_len=self.anchor_len,
                              passing_len=self.passing_len)

    def fingerprint(self) -> dict[str, str]:
        """Per field, a short text that equal requests share on every rank.

        The video is identified by its path and size (``missing`` when absent here), so a rank
        that sees another file, or none, disagrees.
        """
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "mode":
                out["mode"] = value.name
            elif f.name == "video" and isinstance(value, DecodedVideo):
                out["video"] = value.identity()
            elif f.name == "video":
                for g in dataclasses.fields(value):
                    out[f"video.{g.name}"] = repr(getattr(value, g.name))
                if isinstance(value, VideoSpec):
                    out["video.size"] = _file_size(value.path)
            else:
                out[f.name] = repr(value)
        return out


def check_choices(choices: Sequence[str]) -> tuple[str, ...]:
    """``choices`` as a tuple, or ValueError naming what is wrong and the allowed range."""
    if isinstance(choices, str) or not isinstance(choices, Sequence):
        raise ValueError(f"choices must be a sequence of {MIN_CHOICES} .. {MAX_CHOICES} strings, "
                         f"got {type(choices).__name__}")
    if not MIN_CHOICES <= len(choices) <= MAX_CHOICES:
        raise ValueError(f"choices must hold {MIN_CHOICES} .. {MAX_CHOICES} choices, got "
                         f"{len(choices)}")
    for i, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice or len(choice) > MAX_CHOICE_CHARS:
            what = (type(choice).__name__ if not isinstance(choice, str) else
                    "empty" if not choice else f"{len(choice)} characters long")
            raise ValueError(f"choice {i} is {what}; each choice must be a string of 1 .. "
                             f"{MAX_CHOICE_CHARS} characters")
    seen: dict[str, int] = {}
    for i, choice in enumerate(choices):
        if choice in seen:
            raise ValueError(f"choice {i} ({choice[:40]!r}) duplicates choice {seen[choice]}; "
                             f"the choices must be distinct")
        seen[choice] = i
    return tuple(choices)


def check_stop_texts(texts: str | Sequence[str],
                     choices: Sequence[str] | None = None) -> tuple[str, ...]:
    """``texts`` (one string, or a sequence of them) as a tuple, or ValueError naming what is
    wrong and the limits; stop texts with ``choices`` are refused (a closed-vocabulary answer
    generates no text to stop)."""
    if isinstance(texts, str):
        texts = (texts,)
    if not isinstance(texts, Sequence) or len(texts) > MAX_STOP_TEXTS or not all(
            isinstance(t, str) and 0 < len(t) <= MAX_STOP_CHARS for t in texts):
        raise ValueError(f"stop must be a string or a list of at most {MAX_STOP_TEXTS} "
                         f"strings of 1 .. {MAX_STOP_CHARS} characters, got {texts!r}"[:300])
    if texts and choices is not None:
        raise ValueError("stop texts end a generated answer; a request with choices "
                         "generates none: give one or the other")
    return tuple(texts)


def cut_at_stop(text: str, stop_texts: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the first place where one of ``stop_texts`` begins, and whether one
    did."""
    found = [i for i in (text.find(s) for s in stop_texts) if i >= 0]
    return (text[:min(found)], True) if found else (text, False)


def _file_size(path: str) -> str:
    try:
        return f"{os.stat(path).st_size} bytes"
    except OSError:
        return "missing"


@dataclass(frozen=True)
class PromptInputs:
    """A preprocessed request as one rank holds it."""

    context_ids: torch.Tensor
    """(N,) int64: everything before the question, video placeholders expanded."""
    query_ids: torch.Tensor
    """(Q,) int64: the question and the assistant header."""
    video_grid: tuple[int, int, int]
    """(t, h, w) patch grid of the whole video (as the processor's video_grid_thw)."""
    second_per_grid_t: float
    """Seconds per temporal patch (temporal_patch_size / sampled fps)."""
    patch_ranges: tuple[Range, ...]
    """The frame split: per rank, the temporal patches [p0, p1) it encodes ((0, t) everywhere
    when the mode does not split the vision work)."""
    pixel_values: torch.Tensor | None
    """The rows of this rank's patches only: ((p1 - p0) * h * w, C * 2 * 14 * 14); None when
    ``vision_embeds`` came from the vision cache or ``frame_chunks`` are given."""
    num_frames: int
    """Frames sampled from the video (all ranks together)."""
    choice_ids: list[list[int]] | None = None
    """With ``Request.choices``: each choice's tokens (plain text), tokenized once here."""
    vision_embeds: torch.Tensor | None = None
    """This rank's vision tower output, from the vision cache (then the tower is skipped)."""
    frame_chunks: Iterable[torch.Tensor] | None = field(default=None, repr=False, compare=False)
    """With ``vision.pipeline``: this rank's frames, uint8 chunks of whole temporal patches
    (decoded as they are reached), for :meth:`apbv.model.adapter.VideoModel.encode_frames`;
    ``pixel_values`` is then None."""
    vision_store: Callable[[torch.Tensor], None] | None = field(default=None, repr=False,
                                                                compare=False)
    """Called with this rank's vision tower output when it was computed (fills the cache)."""
    snapped: tuple[tuple[int, int, int], ...] | None = None
    """With ``video.snap_to_keyframes``: :attr:`apbv.video.Sampling.moved`; None otherwise."""
    kept: tuple[int, ...] | None = None
    """With temporal pruning: the temporal patches of ``video_grid`` that stay, in order (the
    prompt holds only theirs; ``patch_ranges`` then count kept patches); None: all."""
    kept_tokens: torch.Tensor | None = None
    """With per-token pruning (``Request.pruning_rate``): (len(kept), S) bool, per kept patch
    which of its S tokens stay (the same on every rank); the tower encodes the kept patches
    whole and the other rows are dropped after it. None: every token of a kept patch."""
    positions: torch.Tensor | None = None
    """(3, 1, N + Q) int64 positions of the prompt when preprocessing made them (per-token
    pruning: :func:`apbv.engine.pruned.pruned_inputs`); None: the family's rule at prefill."""


@dataclass
class Result:
    """What a request returns, from the runtime up to the CLI's JSON (identical on every rank)."""

    answer: str
    token_ids: list[int]
    ttft_s: float
    seconds: dict[str, float]
    """Per stage, max over ranks."""
    mode: str
    world_size: int
    frames: int
    context_len: int
    query_len: int
    anchor_len: int
    passing_len: int
    embedding_bytes: int
    """Video embedding bytes moved between ranks."""
    allgather_bytes: int
    """What an all-gather of every embedding to every rank would have moved."""
    kv_cache_bytes_max: int
    """The largest per-rank prompt KV cache."""
    vision_cache_hit: bool = False
    """True when every rank took its vision embeddings from its vision cache."""
    choices: list[dict[str, Any]] | None = None
    """With ``Request.choices``: per choice, in the request's order, {"text", "tokens" (count),
    "logprob" (of its tokens after the prompt, exact), "prob" (softmax over the choices'
    logprobs)}; ``answer`` is then the most probable choice and ``token_ids`` its tokens."""
    first_logits: torch.Tensor | None = field(default=None, repr=False)
    """(vocab,) fp32 logits of the first token (not part of the JSON)."""
    finish_reason: str = "stop"
    """Why the answer ended: ``stop`` (EOS, a stop text, or the choices scored), ``length``
    (max_new_tokens) or ``cancelled`` (the caller's ``stop`` callable)."""
    logprobs: list[dict[str, Any]] | None = None
    """With ``Request.sampling.logprobs``: per generated token, its
    :meth:`~apbv.engine.sampling.Sampling.record` (from the query rank's fp32 logits)."""
    others: list[dict[str, Any]] | None = None
    """With ``Request.n`` > 1: the answers after the first, in order, each {"answer",
    "token_ids", "finish_reason", "logprobs"} (as this result's own fields)."""
    snapped_frames: list[dict[str, int]] | None = None
    """With ``video.snap_to_keyframes``: per sampled frame that moved to a keyframe,
    {"position" (among the sampled frames), "frame" (the index the sampling rule gave),
    "keyframe" (the index decoded instead)}, indices into the file's frames (seconds: index /
    the file's fps); [] when none moved. None without snapping (exact sampling)."""

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        del out["first_logits"]
        return out
