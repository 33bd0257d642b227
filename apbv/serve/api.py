"""OpenAI chat-completions requests in, engine Requests out (the answers' shapes:
:mod:`apbv.serve.responses`).

:func:`parse_chat` reads one ``POST /v1/chat/completions`` body (a user message with one
``video_url`` part and text parts, at most one system message, whose text goes into the chat
template's system turn, ``max_tokens``, sampling (``temperature``, ``top_p``, ``top_k``,
``seed``), ``logprobs``/``top_logprobs``, ``stream`` and ``stream_options``, and apbv's own
fields ``mode``, ``fps``/``nframes``, ``max_pixels``, ``choice_set``, ``deadline_ms``, with
vLLM's spellings of them: :class:`apbv.serve.chat_body.ChatBody` lists them all and is the
schema ``/docs`` shows) into a resolved :class:`apbv.engine.request.Request` (a remote video is
named, then downloaded by the caller and put in with :func:`with_download`; a ``data:`` video
is stored at once); :func:`check_request` applies the limits that need the file (duration,
frames, pixels, prompt tokens, logit_bias's token ids) without decoding a frame. Every field
is classed by :mod:`apbv.serve.chat_fields`: acted on; harmless, or unknown, and reported (the
call's ``ignored``, as vLLM tolerates unknown fields); or changing the answer where apbv cannot
act on it, and refused naming it (400).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from apbv.engine.request import MAX_ANSWERS, Request
from apbv.serve import chat_body, chat_fields, structured
from apbv.serve.bodies import check_url
from apbv.serve.download import Held, discard, store_data_url
from apbv.serve.policy import ClientError, Limits, MediaPolicy, remote_url, resolve_media
from apbv.video import VideoSpec

if TYPE_CHECKING:
    from apbv.config import RuntimeConfig


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


def parse_chat(body: object, cfg: RuntimeConfig, limits: Limits, policy: MediaPolicy,
               model_name: str, lenient: bool = False) -> ChatCall:
    """The engine request of one chat body, or ClientError naming what is wrong; nothing is
    downloaded here (a remote video's URL is the call's ``remote``; a ``data:`` video is
    decoded and stored, the call holding it) and no file is read but a local video's path
    checks (call it off the event loop). Each field is acted on, ignored and reported, or
    refused as :mod:`apbv.serve.chat_fields` classes it (``lenient``: the unsupported ones
    ignored and reported instead, ``--ignore-unsupported-fields``)."""
    if not isinstance(body, dict):
        raise ClientError(400, "the request body must be a JSON object")
    chat_body.check_fields(body)
    ignored = chat_fields.classify(body, lenient)
    n = body.get("n") or 1
    if n > MAX_ANSWERS or (n > 1 and body.get("stream") is True):
        raise ClientError(400, f"n={n} is over the limit of {MAX_ANSWERS} answers per request"
                          if n > MAX_ANSWERS else f"n={n} is not streamed: one streamed "
                          "answer per request (n=1), or stream: false for n answers",
                          param="n")
    if body.get("model") not in (None, model_name):
        raise ClientError(404, f"model {body['model'][:200]!r} is not served; this server "
                               f"serves {model_name!r}", param="model")
    options = body.get("stream_options") or {}
    chat_body.typed_field(options, "include_usage", (bool,), param="stream_options.include_usage")
    ignored += [f"stream_options.{k}" for k in sorted(options) if k != "include_usage"]
    found = structured.grammar(body)
    if found is not None:
        from llguidance import LLMatcher

        problem = LLMatcher.validate_grammar(found[1])
        if problem and not problem.startswith("WARNING"):
            raise ClientError(400, f"{found[0]} cannot be followed: {problem[:300]}",
                              param=found[0])
    sampling = chat_body.sampling(body, None if found is None else found[1])
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
    video_kwargs = chat_body.video_kwargs(body, ignored)
    fps, nframes = video_kwargs["fps"], video_kwargs["nframes"]
    if fps is not None and nframes is not None:
        raise ClientError(400, f"fps ({fps}) and nframes ({nframes}) exclude each other",
                          param="nframes")
    choices = chat_body.choice_set(body)
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
        request = dataclasses.replace(request, n=n)
    except ValueError as exc:
        discard(downloaded)
        raise ClientError(400, str(exc)) from None
    except BaseException:
        discard(downloaded)
        raise
    return ChatCall(request, body.get("stream") is True, model_name, body.get("deadline_ms"),
                    downloaded=downloaded, remote=remote,
                    include_usage=options.get("include_usage") is True, ignored=tuple(ignored))


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


def check_request(request: Request, limits: Limits, processor: Any,
                  world_size: int = 1) -> dict[str, int]:
    """Duration, sampled frames, pixels per frame and prompt tokens of ``request`` against
    ``limits`` (probe and plan_sampling: no frame is decoded); returns what was measured,
    with the decode work of the file's keyframe layout on ``world_size`` ranks
    (:func:`apbv.video.gop.decode_work`, which deadline admission prices)."""
    from apbv.model.front import prompt_rules
    from apbv.video import probe
    from apbv.video.gop import decode_work

    video = request.video
    assert isinstance(video, VideoSpec), video  # a chat request names a file
    rules = prompt_rules(processor)  # the model family's frames and prompt
    try:
        meta = probe(video)
        sampling = rules.plan_sampling(video, meta)
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
    context, query = rules.prompt(request.question, rules.video_grid(sampling), request.system,
                                  sampling=sampling)
    tokens = len(context) + len(query)
    limits.check("prompt", tokens, limits.max_prompt_tokens, "max-prompt-tokens",
                 "the prompt's token count")
    if request.sampling.rules.grammar is not None:
        from apbv.engine.grammar import grammar_error

        problem = grammar_error(request.sampling.rules.grammar, processor.tokenizer)
        if problem is not None:
            raise ClientError(400, f"the structured output's grammar does not fit the model's "
                                   f"tokenizer: {problem[:300]}")
    beyond = [t for t, _ in request.sampling.rules.logit_bias if t >= len(processor.tokenizer)]
    if beyond:
        raise ClientError(400, f"logit_bias names token id {beyond[0]}, beyond the "
                               f"vocabulary of {len(processor.tokenizer)} tokens",
                          param="logit_bias")
    return {"frames": sampling.num_frames, "prompt_tokens": tokens, "context_len": len(context),
            "query_len": len(query), "pixels": pixels, "height": sampling.resized_height,
            "width": sampling.resized_width, **decode_work(meta, sampling, world_size)}


