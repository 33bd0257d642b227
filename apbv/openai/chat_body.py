"""The chat request body as a typed model, and the readers of its fields that ``parse_chat``
(:mod:`apbv.openai.chat`) applies.

:class:`ChatBody` lists OpenAI's fields, vLLM's spellings and apbv's own (the schema ``/docs``
shows); :func:`check_fields` checks each scalar field by the model's own type and lower bound
(:func:`typed_field`: by type, never by truthiness) and returns the fields it does not know;
:func:`sampling`, :func:`video_kwargs` and :func:`choice_set` read the sampling settings, the
video sampling (``fps``/``nframes``/``max_pixels`` or vLLM's ``mm_processor_kwargs`` and
``media_io_kwargs``) and the closed vocabulary under each of its names (:data:`CHOICE_ALIASES`).
Every refusal is a ClientError(400) naming the field (``param``).
"""

from __future__ import annotations

import math
import secrets
import types
import typing
from typing import Any, cast

from pydantic import BaseModel, ConfigDict, Field

from apbv.engine.logits_rules import MAX_PENALTY, MAX_REPETITION_PENALTY, LogitsRules
from apbv.engine.sampling import MAX_SEED, MAX_TOP_LOGPROBS, Sampling
from apbv.openai.policy import ClientError


class ChatBody(BaseModel):
    """The body of ``POST /v1/chat/completions``: OpenAI's fields, vLLM's and apbv's own.

    Its scalar fields' types and lower bounds are the checks :func:`parse_chat` applies
    (:func:`check_fields`); other fields are accepted and reported as ignored."""

    model_config = ConfigDict(extra="allow")

    messages: list[dict[str, Any]] = Field(
        description="One user message (a video_url part, or image_url parts: the frames "
                    "of one video, and text parts) and at most one system message")
    model: str | None = Field(None, description="The served model's id (see /v1/models)")
    max_tokens: int | None = Field(None, ge=1, description="Tokens to generate at most")
    max_completion_tokens: int | None = Field(None, ge=1, description="max_tokens' new name")
    temperature: float | None = Field(None, ge=0, description="0 (default): greedy; else "
                                                              "sampled, up to 2")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling mass")
    top_k: int | None = Field(None, ge=-1, description="Sample among the k likeliest tokens "
                                                       "(0 or -1: all)")
    seed: int | None = Field(None, ge=0, description="Seeds sampling: the same seed gives the "
                                                     "same answer")
    n: int | None = Field(None, ge=1, description="Answers per request: only 1")
    logprobs: bool | None = Field(None, description="Report each token's log-probability")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="Alternatives per token (with logprobs)")
    stream: bool | None = Field(None, description="Answer as server-sent events")
    stream_options: dict[str, Any] | None = Field(
        None, description="{'include_usage': true}: usage in its own last event")
    stop: str | list[str] | None = Field(None, description="Texts that end the answer")
    ignore_eos: bool | None = Field(None, description="Go on past EOS up to max_tokens")
    min_tokens: int | None = Field(None, ge=0, description="EOS and stop texts wait for this "
                                                           "many tokens")
    repetition_penalty: float | None = Field(None, gt=0, le=MAX_REPETITION_PENALTY,
                                             description="Answer tokens' logits divided (> 0) "
                                                         "or multiplied by it")
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY,
                                           description="Subtracted once per answer token")
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY,
                                            description="Subtracted per occurrence in the "
                                                        "answer")
    logit_bias: dict[str, float] | None = Field(None, description="Token id -> bias added "
                                                                  "to its logit (-100 .. 100)")
    user: str | None = None
    mode: str | None = Field(None, description="Attention mode (spava, exact, ...)")
    fps: float | None = Field(None, ge=0, description="Frames sampled per second (of "
                                                      "image_url frames: their rate, default 2)")
    nframes: int | None = Field(None, ge=2, description="Frames sampled in all (not with fps)")
    max_pixels: int | None = Field(None, ge=1, description="Pixel budget of a sampled frame")
    deadline_ms: float | None = Field(None, ge=0, description="Refuse at once (503) when the "
                                                              "first token cannot come in time")
    choice_set: list[str] | None = Field(
        None, description="Closed vocabulary: score these answers instead of generating")
    choices: list[str] | None = Field(None, deprecated=True,
                                      description="Old name of choice_set")
    guided_choice: list[str] | None = Field(None, description="vLLM's name of choice_set")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's {'choice': [...]} (choice_set), or one of 'json' (a "
                          "schema), 'regex', 'grammar' (Lark or GBNF), 'json_object': true")
    response_format: dict[str, Any] | None = Field(
        None, description="{'type': 'json_object'} or {'type': 'json_schema', 'json_schema': "
                          "{'name', 'schema'}}: the answer follows it")
    guided_json: dict[str, Any] | str | None = Field(None, description="structured_outputs."
                                                                       "json's old name")
    guided_regex: str | None = Field(None, description="structured_outputs.regex's old name")
    guided_grammar: str | None = Field(None, description="structured_outputs.grammar's old "
                                                         "name")
    static_threshold: float | None = Field(
        None, ge=0, description="Temporal pruning: temporal patches that changed by less than "
                                "this many levels (0-255) are dropped (0: off)")
    video_pruning_rate: float | None = Field(
        None, ge=0, description="vLLM's per-token pruning rate in [0, 1) (0: off)")
    mm_processor_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's {'fps', 'nframes', 'max_pixels', 'video_pruning_rate'}")
    media_io_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's {'video': {'num_frames': N}}: nframes")


MM_KWARGS = ("fps", "nframes", "max_pixels", "video_pruning_rate")
"""The keys of vLLM's ``mm_processor_kwargs`` taken, as the fields of the same names."""
CHOICE_ALIASES = ("choice_set", "choices", "guided_choice", "structured_outputs.choice")
"""The spellings of the closed vocabulary (``choices``: deprecated, it clashes with the
response's ``choices``)."""


def typed_field(body: dict, name: str, kinds: tuple[type, ...], low: float | None = None,
                param: str | None = None, default: Any = None) -> Any:
    """``body[name]`` (``default`` when absent: only then, a 0 given is kept) if it is one of
    ``kinds`` and at least ``low``: by type, never by truthiness (``"false"`` is no boolean,
    ``true`` no number); a float must be finite (JSON bodies may hold NaN and Infinity
    literals). ``param``: the field's path in the error (default ``name``)."""
    value = body.get(name)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds) or \
            (isinstance(value, float) and not math.isfinite(value)) or \
            (low is not None and cast(float, value) < low):
        what = ("true or false" if kinds == (bool,) else "an integer" if kinds == (int,)
                else "a string" if kinds == (str,) else "an object" if kinds == (dict,)
                else "a finite number")
        raise ClientError(400, f"{name} must be {what}"
                               f"{f' >= {low:g}' if low is not None else ''}, got {value!r}",
                          param=param or name)
    return value


_KINDS: dict[Any, tuple[type, ...]] = {int: (int,), float: (int, float), bool: (bool,),
                                       str: (str,)}


def _scalar_checks(model: type[BaseModel]) -> dict[str, tuple[tuple[type, ...], float | None]]:
    """Per scalar field of ``model`` (one of int, float, bool, str, dict, or None), the
    (kinds, lower bound) that :func:`typed_field` checks: the model's own annotation and
    ``ge`` bound."""
    out = {}
    for name, info in model.model_fields.items():
        args = [a for a in typing.get_args(info.annotation) if a is not type(None)] \
            if isinstance(info.annotation, types.UnionType) or \
            typing.get_origin(info.annotation) is typing.Union else [info.annotation]
        if len(args) != 1:
            continue
        kind = typing.get_origin(args[0]) or args[0]
        kinds = _KINDS.get(kind, (dict,) if kind is dict else None)
        if kinds is not None:
            low = next((m.ge for m in info.metadata if hasattr(m, "ge")), None)
            out[name] = (kinds, low)
    return out


FIELD_CHECKS = _scalar_checks(ChatBody)


def check_fields(body: dict) -> list[str]:
    """Each scalar field of ``body`` against :class:`ChatBody` (ClientError 400 naming it);
    returns the fields ChatBody does not know."""
    for name, (kinds, low) in FIELD_CHECKS.items():
        typed_field(body, name, kinds, low)
    return sorted(set(body) - set(ChatBody.model_fields))


def sampling(body: dict, grammar: str | None = None) -> Sampling:
    """The body's sampling and logprobs settings (a random seed when sampling without one),
    its answer following ``grammar`` when given (structured output)."""
    temperature = body.get("temperature") or 0
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is not None and body.get("logprobs") is not True:
        raise ClientError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbelow(MAX_SEED + 1) if temperature else 0
    try:
        return Sampling(temperature=temperature,
                        top_p=1.0 if body.get("top_p") is None else body["top_p"],
                        top_k=body.get("top_k") or 0, seed=seed,
                        logprobs=(top_logprobs or 0) if body.get("logprobs") else None,
                        rules=logits_rules(body, grammar))
    except ValueError as exc:  # the message begins with the field's name
        field = str(exc).split()[0].split("[")[0]
        raise ClientError(400, str(exc), param=field if field in ChatBody.model_fields
                          else None) from None


def logits_rules(body: dict, grammar: str | None = None) -> LogitsRules:
    """The body's ignore_eos, min_tokens, penalties and logit_bias, and ``grammar``
    (ValueError naming the field; the token ids of logit_bias are checked against the
    vocabulary later)."""
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be an object of token id -> bias, got {bias!r:.100}")
    pairs = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 9):
            raise ValueError(f"logit_bias keys must be token ids (digits), got {key!r:.40}")
        pairs.append((int(key), value))
    given = {name: body[name] for name in ("ignore_eos", "min_tokens", "repetition_penalty",
                                           "presence_penalty", "frequency_penalty")
             if body.get(name) is not None}
    return LogitsRules(logit_bias=tuple(sorted(pairs)), grammar=grammar, **given)


def video_kwargs(body: dict, ignored: list[str]) -> dict[str, Any]:
    """fps, nframes, max_pixels and video_pruning_rate from the body's own fields and vLLM's
    ``mm_processor_kwargs`` and ``media_io_kwargs.video.num_frames`` (a value given twice
    must agree); their other keys go to ``ignored``."""
    mm = body.get("mm_processor_kwargs") or {}
    io = body.get("media_io_kwargs") or {}
    io_video = io.get("video") or {}
    if not isinstance(io_video, dict):
        raise ClientError(400, f"media_io_kwargs.video must be an object, got {io_video!r}",
                          param="media_io_kwargs.video")
    ignored += [f"mm_processor_kwargs.{k}" for k in sorted(mm) if k not in MM_KWARGS]
    ignored += [f"media_io_kwargs.{k}" for k in sorted(io) if k != "video"]
    ignored += [f"media_io_kwargs.video.{k}" for k in sorted(io_video) if k != "num_frames"]
    out = {}
    for name in MM_KWARGS:
        kinds, low = FIELD_CHECKS[name]
        given = {name: body.get(name),
                 f"mm_processor_kwargs.{name}": typed_field(
                     mm, name, kinds, low, param=f"mm_processor_kwargs.{name}")}
        if name == "nframes":
            given["media_io_kwargs.video.num_frames"] = typed_field(
                io_video, "num_frames", kinds, low, param="media_io_kwargs.video.num_frames")
        out[name] = one_of(given)
    return out


def choice_set(body: dict) -> list[str] | None:
    """The closed vocabulary, under any of its spellings (:data:`CHOICE_ALIASES`; given
    twice, they must agree); None without one."""
    outputs = body.get("structured_outputs") or {}  # other keys: chat_fields.classify
    given = {name: body.get(name) for name in CHOICE_ALIASES[:3]}
    given["structured_outputs.choice"] = outputs.get("choice")
    choices = one_of(given)
    if choices is not None and (not isinstance(choices, list) or not choices or
                                not all(isinstance(c, str) and c for c in choices)):
        name = next(k for k, v in given.items() if v is not None)
        raise ClientError(400, f"{name} must be a non-empty list of strings, got {choices!r}",
                          param=name)
    return choices


def one_of(given: dict[str, Any]) -> Any:
    """The one value of ``given`` (name -> value or None) that is set, or None; ClientError
    when two names are set to different values."""
    values = {k: v for k, v in given.items() if v is not None}
    if len({repr(v) for v in values.values()}) > 1:
        names = sorted(values)
        raise ClientError(400, f"{' and '.join(names)} differ ({list(values.values())!r:.200}): "
                               "give one of them", param=names[-1])
    return next(iter(values.values()), None)
