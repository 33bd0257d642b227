"""OpenAI chat-completions requests in, engine Requests out; responses and stream chunks back.

:func:`parse_chat` reads one ``POST /v1/chat/completions`` body (a user message with one
``video_url`` part and text parts, at most one system message, whose text goes into the chat
template's system turn, ``max_tokens``, ``temperature`` 0 or absent, ``stream``, and apbv's own
fields ``mode``, ``fps``/``nframes``, ``max_pixels``, ``choices``, ``deadline_ms``)
into a resolved :class:`apbv.engine.request.Request` (a remote video is named, then downloaded
by the caller and put in with :func:`with_download`); :func:`check_request` applies the limits
that need the file (duration, frames, pixels, prompt tokens) without decoding a frame.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, cast

from apbv.engine.request import Request
from apbv.serve.bodies import check_url
from apbv.serve.download import Held
from apbv.serve.policy import ClientError, Limits, MediaPolicy, remote_url, resolve_media
from apbv.video import VideoSpec

KNOWN_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature",
                "stream", "mode", "fps", "nframes", "max_pixels", "choices", "deadline_ms",
                "n", "user", "top_p", "stream_options", "stop"}


@dataclass(frozen=True)
class ChatCall:
    """One parsed chat request: what the engine gets and how to answer."""

    request: Request
    stream: bool
    model: str
    deadline_ms: float | None = None
    downloaded: Held | None = None
    """The stored copy of a remote video, held until the request is over (:func:`discard`)."""
    remote: str | None = None
    """The http(s) URL of a remote video still to download (the request's video path until
    :func:`with_download` puts the download's in); None for a local one."""


def typed_field(body: dict, name: str, kinds: tuple[type, ...], low: float | None = None) -> Any:
    """``body[name]`` (None when absent) if it is one of ``kinds`` and at least ``low``: by
    type, never by truthiness (``"false"`` is no boolean, ``true`` no number); a float must
    be finite (JSON bodies may hold NaN and Infinity literals)."""
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
                               f"{f' >= {low:g}' if low is not None else ''}, got {value!r}")
    return value


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
    downloaded here (a remote video's URL is the call's ``remote``) and no file is read but a
    local video's path checks (call it off the event loop)."""
    if not isinstance(body, dict):
        raise ClientError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise ClientError(400, f"unknown field(s) {unknown}; supported: {sorted(KNOWN_FIELDS)}")
    temperature = typed_field(body, "temperature", (int, float))
    if temperature not in (None, 0):
        raise ClientError(400, f"temperature {temperature!r} is not supported: only greedy "
                               "decoding (temperature 0 or absent)")
    if typed_field(body, "n", (int,)) not in (None, 1):
        raise ClientError(400, f"n={body.get('n')!r} is not supported: only n=1")
    if typed_field(body, "model", (str,)) not in (None, model_name):
        raise ClientError(404, f"model {body['model'][:200]!r} is not served; this server "
                               f"serves {model_name!r}")
    streamed = typed_field(body, "stream", (bool,)) is True
    typed_field(body, "top_p", (int, float))  # accepted for clients' sake; greedy ignores it
    typed_field(body, "user", (str,))
    typed_field(body, "stream_options", (dict,))
    _check_messages(body.get("messages"))
    url, question, system = _message_parts(body)
    url = check_url(url, "video_url.url")
    limits.check("question", len(question), limits.max_question_chars, "max-question-chars",
                 "the question's length in characters")
    if system is not None:
        limits.check("system", len(system), limits.max_question_chars, "max-question-chars",
                     "the system message's length in characters")
    max_tokens = typed_field(body, "max_tokens", (int,), 1)
    if max_tokens is None:
        max_tokens = typed_field(body, "max_completion_tokens", (int,), 1)
    if max_tokens is not None:
        limits.check("max_tokens", max_tokens, limits.max_tokens, "max-tokens",
                     "max_tokens")
    fps = typed_field(body, "fps", (int, float), 0)
    nframes = typed_field(body, "nframes", (int,), 2)
    if fps is not None and nframes is not None:
        raise ClientError(400, f"fps ({fps}) and nframes ({nframes}) exclude each other")
    max_pixels = typed_field(body, "max_pixels", (int,), 1)
    deadline = typed_field(body, "deadline_ms", (int, float), 0)
    mode = body.get("mode")
    if mode is not None and not isinstance(mode, str):
        raise ClientError(400, f"mode must be a string, got {mode!r}")
    remote = remote_url(url, policy)
    path = resolve_media(url, policy) if remote is None else remote
    try:
        request = Request.from_config(cfg, path, question, mode=mode, max_new_tokens=max_tokens,
                                      stop_texts=() if body.get("stop") is None
                                      else body["stop"], system=system)
        # A local path was checked with its links resolved: open exactly that file, no link
        # on the way (the download directory is the server's own).
        assert isinstance(request.video, VideoSpec), request.video  # a path, from_config
        video = dataclasses.replace(request.video, follow_symlinks=remote is not None)
        if fps is not None or nframes is not None:
            video = dataclasses.replace(video, fps=fps, nframes=nframes)
        if max_pixels is not None:
            video = dataclasses.replace(video, max_pixels=max_pixels)
        request = dataclasses.replace(request, video=video)
        choices = body.get("choices")
        if choices is not None:
            request = _with_choices(request, choices)
    except ValueError as exc:
        raise ClientError(400, str(exc)) from None
    return ChatCall(request, streamed, model_name, deadline, remote=remote)


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


def _with_choices(request: Request, choices: object) -> Request:
    if not isinstance(choices, list) or not choices or \
            not all(isinstance(c, str) and c for c in choices):
        raise ClientError(400, f"choices must be a non-empty list of strings, got {choices!r}")
    if "choices" not in {f.name for f in dataclasses.fields(Request)}:
        raise ClientError(400, "choices are not supported by this build")
    return dataclasses.replace(request, choices=tuple(choices))


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
    for name in ("vision_cache_hit", "choices"):
        value = getattr(result, name, None)
        if value is not None:
            out[name] = value
    return out


def completion(call: ChatCall, cid: str, result: Any, queue_wait_s: float,
               replica: int = 0) -> dict[str, Any]:
    return answer(call.model, cid, result, queue_wait_s, replica)


def answer(model: str, cid: str, result: Any, queue_wait_s: float,
           replica: int = 0) -> dict[str, Any]:
    """A chat.completion body for ``result`` (also the answer of a live stream's ask)."""
    return {
        "id": cid, "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": result.answer},
                     "finish_reason": result.finish_reason,
                     "logprobs": None}],
        "usage": usage(result),
        "apbv": apbv_block(result, queue_wait_s, replica),
    }


def chunk(model: str, cid: str, delta: dict[str, Any], finish: str | None = None,
          **extra: Any) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
            **extra}
