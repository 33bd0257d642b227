"""OpenAI chat-completions requests in, engine Requests out; responses and stream chunks back.

:func:`parse_chat` reads one ``POST /v1/chat/completions`` body (a user message with one
``video_url`` part and text parts, at most one system message, whose text goes into the chat
template's system turn, ``max_tokens``, sampling (``temperature``, ``top_p``, ``top_k``,
``seed``), ``logprobs``/``top_logprobs``, ``stream`` and ``stream_options``, and apbv's own
fields ``mode``, ``fps``/``nframes``, ``max_pixels``, ``choice_set``, ``deadline_ms``, with
vLLM's spellings of them: :class:`ChatBody` lists them all and is the schema ``/docs`` shows)
into a resolved :class:`apbv.engine.request.Request` (a remote video is named, then downloaded
by the caller and put in with :func:`with_download`; a ``data:`` video is stored at once);
:func:`check_request` applies the limits that need the file (duration, frames, pixels, prompt
tokens) without decoding a frame. Fields it does not know are accepted, never acted on, and
reported (the call's ``ignored``), as vLLM does.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
import types
import typing
import uuid
from dataclasses import dataclass
from typing import Any, cast

from pydantic import BaseModel, ConfigDict, Field

from apbv.engine.request import Request
from apbv.engine.sampling import MAX_SEED, MAX_TOP_LOGPROBS, Sampling
from apbv.serve.bodies import check_url
from apbv.serve.download import Held, discard, store_data_url
from apbv.serve.policy import ClientError, Limits, MediaPolicy, remote_url, resolve_media
from apbv.video import VideoSpec


class ChatBody(BaseModel):
    """The body of ``POST /v1/chat/completions``: OpenAI's fields, vLLM's and apbv's own.

    Its scalar fields' types and lower bounds are the checks :func:`parse_chat` applies
    (:func:`check_fields`); other fields are accepted and reported as ignored."""

    model_config = ConfigDict(extra="allow")

    messages: list[dict[str, Any]] = Field(
        description="One user message (a video_url part and text parts) and at most one "
                    "system message")
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
    user: str | None = None
    mode: str | None = Field(None, description="Attention mode (spava, exact, ...)")
    fps: float | None = Field(None, ge=0, description="Frames sampled per second")
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
        None, description="vLLM's {'choice': [...]}: choice_set")
    mm_processor_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's {'fps', 'nframes', 'max_pixels'}")
    media_io_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's {'video': {'num_frames': N}}: nframes")


MM_KWARGS = ("fps", "nframes", "max_pixels")
"""The keys of vLLM's ``mm_processor_kwargs`` taken, as the fields of the same names."""
CHOICE_ALIASES = ("choice_set", "choices", "guided_choice", "structured_outputs.choice")
"""The spellings of the closed vocabulary (``choices``: deprecated, it clashes with the
response's ``choices``)."""


@dataclass(frozen=True)
class ChatCall:
    """One parsed chat request: what the engine gets and how to answer."""

    request: Request
    sse: bool
    """Answer with server-sent events (the body's ``stream``)."""
    model: str
    deadline_ms: float | None = None
    downloaded: Held | None = None
    """The stored copy of a remote (or ``data:``) video, held until the request is over
    (:func:`discard`)."""
    remote: str | None = None
    """The http(s) URL of a remote video still to download (the request's video path until
    :func:`with_download` puts the download's in); None for a local one."""
    include_usage: bool = False
    """Streamed: usage in its own last event (``stream_options.include_usage``)."""
    ignored: tuple[str, ...] = ()
    """The body's fields that were not understood, hence not acted on."""


def typed_field(body: dict, name: str, kinds: tuple[type, ...], low: float | None = None,
                param: str | None = None) -> Any:
    """``body[name]`` (None when absent) if it is one of ``kinds`` and at least ``low``: by
    type, never by truthiness (``"false"`` is no boolean, ``true`` no number); a float must
    be finite (JSON bodies may hold NaN and Infinity literals). ``param``: the field's path
    in the error (default ``name``)."""
    value: Any = body.get(name)
    if value is None:
        return None
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


def _message_parts(body: dict) -> tuple[str, str, str | None]:
    """(video URL, question text) of the request's user message, and the text of its system
    message (None without one)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ClientError(400, "messages must be a non-empty list")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    systems = [m for m in messages if isinstance(m, dict) and m.get("role") == "system"]
    others = {m.get("role") for m in messages if isinstance(m, dict)} - {"user", "system"}
    if len(users) != 1 or others or len(systems) > 1:
        raise ClientError(400, f"exactly one user message and at most one system message are "
                               f"supported (got {len(users)} user and {len(systems)} system "
                               f"message(s), other roles {sorted(map(str, others))})")
    content = users[0].get("content")
    if not isinstance(content, list):
        raise ClientError(400, "the user message's content must be a list of parts holding one "
                               "video_url part and text")
    urls, texts = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "video_url" and isinstance(part.get("video_url"), dict):
            urls.append(part["video_url"].get("url"))
        elif kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise ClientError(400, f"unsupported content part {str(part)[:120]!r}: only "
                                   "{'type': 'video_url'} and {'type': 'text'}")
    if len(urls) != 1:
        raise ClientError(400, f"exactly one video_url part is needed, got {len(urls)}")
    question = "\n".join(texts)
    if not question.strip():
        raise ClientError(400, "the user message needs a non-empty text part (the question)")
    return urls[0], question, _system_text(systems[0]) if systems else None


def _system_text(message: dict) -> str:
    """The text of a system message: its content string, or its text parts joined by
    newlines (plain text, as the question)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        raise ClientError(400, f"the system message's content must be a string or a list of "
                               f"{{'type': 'text'}} parts, got {str(content)[:120]!r}")
    return "\n".join(p["text"] for p in content)


def parse_chat(body: object, cfg: Any, limits: Limits, policy: MediaPolicy,
               model_name: str) -> ChatCall:
    """The engine request of one chat body, or ClientError naming what is wrong; nothing is
    downloaded here (a remote video's URL is the call's ``remote``; a ``data:`` video is
    decoded and stored, the call holding it) and no file is read but a local video's path
    checks (call it off the event loop)."""
    if not isinstance(body, dict):
        raise ClientError(400, "the request body must be a JSON object")
    ignored = check_fields(body)
    if body.get("n") not in (None, 1):
        raise ClientError(400, f"n={body['n']!r} is not supported: one answer per request "
                               "(n=1); send the request again for another", param="n")
    if body.get("model") not in (None, model_name):
        raise ClientError(404, f"model {body['model'][:200]!r} is not served; this server "
                               f"serves {model_name!r}", param="model")
    options = body.get("stream_options") or {}
    typed_field(options, "include_usage", (bool,), param="stream_options.include_usage")
    ignored += [f"stream_options.{k}" for k in sorted(options) if k != "include_usage"]
    sampling = _sampling(body)
    _check_messages(body.get("messages"))
    url, question, system = _message_parts(body)
    url = check_url(url, "video_url.url")
    limits.check("question", len(question), limits.max_question_chars, "max-question-chars",
                 "the question's length in characters")
    if system is not None:
        limits.check("system", len(system), limits.max_question_chars, "max-question-chars",
                     "the system message's length in characters")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_completion_tokens")
    if max_tokens is not None:
        limits.check("max_tokens", max_tokens, limits.max_tokens, "max-tokens",
                     "max_tokens")
    video_kwargs = _video_kwargs(body, ignored)
    fps, nframes = video_kwargs["fps"], video_kwargs["nframes"]
    if fps is not None and nframes is not None:
        raise ClientError(400, f"fps ({fps}) and nframes ({nframes}) exclude each other",
                          param="nframes")
    choices = _choice_set(body)
    if url.startswith("data:"):
        remote, downloaded = None, store_data_url(url, policy)
        path = downloaded.path
    else:
        remote, downloaded = remote_url(url, policy), None
        path = resolve_media(url, policy) if remote is None else remote
    try:
        request = Request.from_config(cfg, path, question, mode=body.get("mode"),
                                      max_new_tokens=max_tokens,
                                      stop_texts=() if body.get("stop") is None
                                      else body["stop"], system=system)
        # A local path was checked with its links resolved: open exactly that file, no link
        # on the way (the download directory is the server's own).
        assert isinstance(request.video, VideoSpec), request.video  # a path, from_config
        stored = remote is not None or downloaded is not None
        video = dataclasses.replace(request.video, follow_symlinks=stored)
        if fps is not None or nframes is not None:
            video = dataclasses.replace(video, fps=fps, nframes=nframes)
        if video_kwargs["max_pixels"] is not None:
            video = dataclasses.replace(video, max_pixels=video_kwargs["max_pixels"])
        request = dataclasses.replace(request, video=video, sampling=sampling)
        if choices is not None:
            request = dataclasses.replace(request, choices=tuple(choices))
    except ValueError as exc:
        discard(downloaded)
        raise ClientError(400, str(exc)) from None
    except BaseException:
        discard(downloaded)
        raise
    return ChatCall(request, body.get("stream") is True, model_name, body.get("deadline_ms"),
                    downloaded=downloaded, remote=remote,
                    include_usage=options.get("include_usage") is True, ignored=tuple(ignored))


def _sampling(body: dict) -> Sampling:
    """The body's sampling and logprobs settings (a random seed when sampling without one)."""
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
                        logprobs=(top_logprobs or 0) if body.get("logprobs") else None)
    except ValueError as exc:  # the message begins with the field's name
        field = str(exc).split()[0]
        raise ClientError(400, str(exc), param=field if field in ChatBody.model_fields
                          else None) from None


def _video_kwargs(body: dict, ignored: list[str]) -> dict[str, Any]:
    """fps, nframes and max_pixels from the body's own fields and vLLM's
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
        out[name] = _one_of(given)
    return out


def _choice_set(body: dict) -> list[str] | None:
    """The closed vocabulary, under any of its spellings (:data:`CHOICE_ALIASES`; given
    twice, they must agree); None without one."""
    outputs = body.get("structured_outputs") or {}
    others = sorted(set(outputs) - {"choice"})
    if others:
        raise ClientError(400, f"structured_outputs {others} are not supported: only "
                               "{'choice': [...]} (a closed vocabulary)",
                          param=f"structured_outputs.{others[0]}")
    given = {name: body.get(name) for name in CHOICE_ALIASES[:3]}
    given["structured_outputs.choice"] = outputs.get("choice")
    choices = _one_of(given)
    if choices is not None and (not isinstance(choices, list) or not choices or
                                not all(isinstance(c, str) and c for c in choices)):
        name = next(k for k, v in given.items() if v is not None)
        raise ClientError(400, f"{name} must be a non-empty list of strings, got {choices!r}",
                          param=name)
    return choices


def _one_of(given: dict[str, Any]) -> Any:
    """The one value of ``given`` (name -> value or None) that is set, or None; ClientError
    when two names are set to different values."""
    values = {k: v for k, v in given.items() if v is not None}
    if len({repr(v) for v in values.values()}) > 1:
        names = sorted(values)
        raise ClientError(400, f"{' and '.join(names)} differ ({list(values.values())!r:.200}): "
                               "give one of them", param=names[-1])
    return next(iter(values.values()), None)


def with_download(call: ChatCall, downloaded: Held) -> ChatCall:
    """``call`` (with a ``remote`` video) on the stored file ``downloaded``, which it holds."""
    assert call.remote is not None and call.downloaded is None, call
    assert isinstance(call.request.video, VideoSpec), call.request.video
    video = dataclasses.replace(call.request.video, path=downloaded.path)
    return dataclasses.replace(call, request=dataclasses.replace(call.request, video=video),
                               downloaded=downloaded, remote=None)


def _check_messages(messages: object) -> None:
    """Each message an object whose role is a string (the roles are judged after)."""
    if not isinstance(messages, list):
        return  # refused with the message parts
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ClientError(400, f"messages[{i}] must be an object with a string role, got "
                                   f"{str(message)[:120]!r}")


def check_request(request: Request, limits: Limits, processor: Any) -> dict[str, int]:
    """Duration, sampled frames, pixels per frame and prompt tokens of ``request`` against
    ``limits`` (probe and plan_sampling: no frame is decoded); returns what was measured."""
    from apbv.sequence import build_prompt
    from apbv.video import plan_sampling, probe

    video = request.video
    assert isinstance(video, VideoSpec), video  # a chat request names a file
    try:
        meta = probe(video)
        sampling = plan_sampling(video, meta)
    except ValueError as exc:
        raise ClientError(400, str(exc)) from None
    seconds = min(meta.duration, video.video_end or meta.duration) - (video.video_start or 0)
    limits.check("duration", round(seconds, 3), limits.max_video_seconds, "max-video-seconds",
                 "the video's duration in seconds")
    limits.check("frames", sampling.num_frames, limits.max_frames, "max-frames",
                 "the number of sampled frames")
    pixels = sampling.resized_height * sampling.resized_width
    limits.check("pixels", pixels, limits.max_pixels_per_frame, "max-pixels-per-frame",
                 "pixels per sampled frame")
    t, h, w = sampling.grid_thw
    merge = getattr(processor.video_processor, "merge_size", 2)
    context, query = build_prompt(processor, request.question, t * (h // merge) * (w // merge),
                                  request.system)
    tokens = len(context) + len(query)
    limits.check("prompt", tokens, limits.max_prompt_tokens, "max-prompt-tokens",
                 "the prompt's token count")
    return {"frames": sampling.num_frames, "prompt_tokens": tokens, "context_len": len(context),
            "query_len": len(query), "pixels": pixels, "height": sampling.resized_height,
            "width": sampling.resized_width}


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def usage(result: Any) -> dict[str, int]:
    prompt = result.context_len + result.query_len
    return {"prompt_tokens": prompt, "completion_tokens": len(result.token_ids),
            "total_tokens": prompt + len(result.token_ids)}


def apbv_block(result: Any, queue_wait_s: float, replica: int = 0) -> dict[str, Any]:
    out = {"replica": replica, "ttft_s": result.ttft_s, "seconds": result.seconds,
           "mode": result.mode, "world_size": result.world_size, "context_len": result.context_len,
           "query_len": result.query_len, "anchor_len": result.anchor_len,
           "passing_len": result.passing_len, "frames": result.frames,
           "token_ids": list(result.token_ids), "queue_wait_s": queue_wait_s}
    for name in ("vision_cache_hit", "choices", "snapped_frames"):
        value = getattr(result, name, None)
        if value is not None:
            out[name] = value
    return out


def completion(call: ChatCall, cid: str, result: Any, queue_wait_s: float,
               replica: int = 0, tokenizer: Any = None) -> dict[str, Any]:
    out = answer(call.model, cid, result, queue_wait_s, replica, tokenizer)
    if call.ignored:
        out["apbv"]["ignored_fields"] = list(call.ignored)
    return out


def answer(model: str, cid: str, result: Any, queue_wait_s: float,
           replica: int = 0, tokenizer: Any = None) -> dict[str, Any]:
    """A chat.completion body for ``result`` (also the answer of a live stream's ask); its
    log-probabilities, when the request asked for them, named by ``tokenizer``."""
    return {
        "id": cid, "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": result.answer},
                     "finish_reason": result.finish_reason,
                     "logprobs": logprobs(result, tokenizer)}],
        "usage": usage(result),
        "apbv": apbv_block(result, queue_wait_s, replica),
    }


def logprobs(result: Any, tokenizer: Any) -> dict[str, Any] | None:
    """OpenAI's ``logprobs`` of a choice ({"content": [{"token", "logprob", "bytes",
    "top_logprobs": [...]}, ...]}, one entry per generated token) from the result's records
    (:meth:`apbv.engine.sampling.Sampling.record`); None when none were asked for."""
    records = getattr(result, "logprobs", None)
    if records is None or tokenizer is None:
        return None

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(r["id"], r["logprob"]),
                         "top_logprobs": [entry(i, lp) for i, lp in r["top"]]}
                        for r in records]}


def chunk(model: str, cid: str, delta: dict[str, Any], finish: str | None = None,
          logprobs: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                         "logprobs": logprobs}],
            **extra}


def usage_chunk(model: str, cid: str, result: Any) -> dict[str, Any]:
    """The last event of a streamed answer that asked for usage
    (``stream_options.include_usage``): no choices, the usage."""
    return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "choices": [], "usage": usage(result)}
