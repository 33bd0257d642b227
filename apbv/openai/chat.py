"""OpenAI chat-completions requests in, engine Requests out (the answers' shapes:
:mod:`apbv.openai.responses`).

:func:`parse_chat` reads one ``POST /v1/chat/completions`` body (a user message with one
``video_url`` part, or ``image_url`` parts that are the frames of one video
(:mod:`apbv.openai.image_parts`), and text parts, at most one system message, whose text goes
into the chat template's system turn, ``max_tokens``, sampling (``temperature``, ``top_p``,
``top_k``, ``seed``), ``logprobs``/``top_logprobs``, ``stream`` and ``stream_options``, and
apbv's own fields ``mode``, ``fps``/``nframes``, ``max_pixels``, ``choice_set``,
``deadline_ms``, with vLLM's spellings of them: :class:`apbv.openai.chat_body.ChatBody` lists
them all and is the schema ``/docs`` shows) into a resolved
:class:`apbv.engine.request.Request` (a remote video is named, then downloaded by the caller
and put in with :func:`with_download`; a ``data:`` video is stored at once; image frames are
decoded at once; every ``data:`` URL counts against ``--max-data-bytes``);
:func:`check_request` applies the limits that need the file (duration, frames, pixels, prompt
tokens, logit_bias's token ids) without decoding a frame. Every field is classed by
:mod:`apbv.openai.chat_fields`: acted on; harmless, or unknown, and reported (the call's
``ignored``, as vLLM tolerates unknown fields); or changing the answer where apbv cannot act on
it, and refused naming it (400).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from apbv.engine.request import MAX_ANSWERS, Request
from apbv.openai import chat_body, chat_fields, image_parts, structured
from apbv.openai.bodies import check_url
from apbv.openai.download import Held, discard, store_data_url
from apbv.openai.policy import ClientError, Limits, MediaPolicy, remote_url, resolve_media
from apbv.validate import pruning_settings
from apbv.video import DecodedVideo, VideoSpec

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


@dataclass(frozen=True)
class MessageParts:
    """What the user message (and the system message) of a chat body hold."""

    videos: list[object]
    """The ``video_url`` parts' URLs (unchecked)."""
    images: list[object]
    """The ``image_url`` parts' URLs (unchecked), in order: the frames of one video."""
    question: str
    system: str | None
    ignored: list[str]
    """Keys of the parts that are not acted on (``image_url.detail``)."""


def _message_parts(body: dict) -> MessageParts:
    """The video URL(s), image URLs and question text of the request's user message, and the
    text of its system message (None without one)."""
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
        raise ClientError(400, "the user message's content must be a list of parts: one "
                               "video_url part or image_url parts (frames), and text")
    videos, images, texts, ignored = [], [], [], set()
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "video_url" and isinstance(part.get("video_url"), dict):
            videos.append(part["video_url"].get("url"))
        elif kind == "image_url" and isinstance(part.get("image_url"), dict):
            images.append(part["image_url"].get("url"))
            ignored |= {f"image_url.{k}" for k in part["image_url"] if k != "url"}
        elif kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise ClientError(400, f"unsupported content part {str(part)[:120]!r}: only "
                                   "{'type': 'video_url'}, {'type': 'image_url'} and "
                                   "{'type': 'text'}")
    if len(videos) > 1 or (videos and images):
        raise ClientError(400, f"one video per request: one video_url part or image_url parts "
                               f"(its frames), got {len(videos)} video_url and {len(images)} "
                               "image_url part(s)")
    if not videos and not images:
        raise ClientError(400, "the user message needs a video: one video_url part or "
                               "image_url parts (its frames); text-only requests are not "
                               "supported")
    question = "\n".join(texts)
    if not question.strip():
        raise ClientError(400, "the user message needs a non-empty text part (the question)")
    return MessageParts(videos, images, question,
                        _system_text(systems[0]) if systems else None, sorted(ignored))


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
               model_name: str, lenient: bool = False,
               body_bytes: int | None = None) -> ChatCall:
    """The engine request of one chat body, or ClientError naming what is wrong; nothing is
    downloaded here (a remote video's URL is the call's ``remote``; a ``data:`` video is
    decoded and stored, the call holding it; image frames are decoded) and no file is read
    but a local video's path checks and ``file://`` images (call it off the event loop).
    Each field is acted on, ignored and reported, or refused as :mod:`apbv.openai.chat_fields`
    classes it (``lenient``: the unsupported ones ignored and reported instead,
    ``--ignore-unsupported-fields``). ``body_bytes``: the body's size as sent, whose part
    outside its ``data:`` URLs must stay within --max-body-bytes (None: not checked, a body
    not read from HTTP)."""
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
    parts = _message_parts(body)
    question, system = parts.question, parts.system
    ignored += parts.ignored
    urls = [check_url(u, "video_url.url") for u in parts.videos] + \
        [check_url(u, f"image_url.url of image {i}") for i, u in enumerate(parts.images)]
    data = image_parts.data_size(urls, limits)
    if body_bytes is not None:
        limits.check("body", body_bytes - data, limits.max_body_bytes, "max-body-bytes",
                     "the request body without its data: URLs")
    limits.check("question", len(question), limits.max_question_chars, "max-question-chars",
                 "the question's length in characters")
    if system is not None:
        limits.check("system", len(system), limits.max_question_chars, "max-question-chars",
                     "the system message's length in characters")
    max_tokens = chat_body.one_of({"max_tokens": body.get("max_tokens"), "max_completion_tokens":
                                   body.get("max_completion_tokens")})
    if max_tokens is not None:
        limits.check("max_tokens", max_tokens, limits.max_tokens, "max-tokens",
                     "max_tokens")
    video_kwargs = chat_body.video_kwargs(body, ignored)
    fps, nframes = video_kwargs["fps"], video_kwargs["nframes"]
    if fps is not None and nframes is not None:
        raise ClientError(400, f"fps ({fps}) and nframes ({nframes}) exclude each other",
                          param="nframes")
    if parts.images and nframes is not None:
        raise ClientError(400, f"nframes ({nframes}) samples a video file; frames sent as "
                               f"image_url parts are all taken ({len(parts.images)} here)",
                          param="nframes")
    choices = chat_body.choice_set(body)
    if parts.images:
        request = _image_request(cfg, urls, question, system, body, max_tokens, fps,
                                 video_kwargs["max_pixels"], limits, policy)
        request = _pruning(body, video_kwargs, dataclasses.replace(request, sampling=sampling))
        if choices is not None:
            request = _with_choices(request, choices)
        request = dataclasses.replace(request, n=n)
        return ChatCall(request, body.get("stream") is True, model_name,
                        body.get("deadline_ms"), include_usage=options.get("include_usage")
                        is True, ignored=tuple(ignored))
    url = urls[0]
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
        request = _pruning(body, video_kwargs,
                           dataclasses.replace(request, video=video, sampling=sampling))
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


def _pruning(body: dict, video_kwargs: dict[str, Any], request: Request) -> Request:
    """``request`` with the temporal pruning settings the body sets (``static_threshold``,
    ``video_pruning_rate`` or ``mm_processor_kwargs.video_pruning_rate``; the server's
    otherwise), or ClientError 400 naming the field."""
    rate = video_kwargs["video_pruning_rate"]
    threshold = body.get("static_threshold")
    out = {"pruning_rate": request.pruning_rate if rate is None else float(rate),
           "static_threshold": request.static_threshold if threshold is None
           else float(threshold)}
    try:
        pruning_settings(out["pruning_rate"], out["static_threshold"],
                         names=("video_pruning_rate", "static_threshold"))
    except ValueError as exc:
        param = "static_threshold" if str(exc).startswith("static") else "video_pruning_rate"
        raise ClientError(400, str(exc), param=param) from None
    return dataclasses.replace(request, pruning_rate=out["pruning_rate"],
                               static_threshold=out["static_threshold"])


def _image_request(cfg: RuntimeConfig, urls: list[str], question: str, system: str | None,
                   body: dict, max_tokens: int | None, fps: float | None,
                   max_pixels: int | None, limits: Limits, policy: MediaPolicy) -> Request:
    """The request on the frames sent as the image URLs ``urls``
    (:func:`apbv.openai.image_parts.image_video`, sized by the config's video pixel bounds, or
    the request's ``max_pixels``, and the checkpoint's patch size)."""
    spec = cfg.video.spec("<image frames>")
    patch = image_parts.patch_size(cfg.model.path) if cfg.model.path else None
    changes: dict[str, Any] = {} if patch is None else {"image_patch_size": patch}
    if max_pixels is not None:
        changes["max_pixels"] = max_pixels
    try:
        spec = dataclasses.replace(spec, **changes)
        video = image_parts.image_video(urls, spec, fps, limits, policy)
        return dataclasses.replace(
            Request.from_config(cfg, "<image frames>", question, mode=body.get("mode"),
                                max_new_tokens=max_tokens, system=system,
                                stop_texts=() if body.get("stop") is None else body["stop"]),
            video=video)
    except ValueError as exc:
        raise ClientError(400, str(exc)) from None


def _with_choices(request: Request, choices: list[str]) -> Request:
    try:
        return dataclasses.replace(request, choices=tuple(choices))
    except ValueError as exc:
        raise ClientError(400, str(exc)) from None


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
    """The native frame size (from the container's header, before the decoder opens the file),
    duration, sampled frames, pixels per frame and prompt tokens of ``request`` against
    ``limits`` (probe and plan_sampling: no frame is decoded); returns what was measured,
    with the decode work of the file's keyframe layout on ``world_size`` ranks
    (:func:`apbv.video.gop.decode_work`, which deadline admission prices). Frames sent as
    images (a DecodedVideo) are measured as they are, nothing probed. A mode that splits the
    frames among the ranks needs a temporal patch per rank (else 400)."""
    from apbv.model.front import prompt_rules
    from apbv.plan import patch_ranges
    from apbv.video import probe
    from apbv.video.gop import decode_work
    from apbv.video.header import check_native_size, check_pixels

    video = request.video
    rules = prompt_rules(processor)  # the model family's frames and prompt
    meta = None
    if isinstance(video, DecodedVideo):  # frames sent as images: nothing to probe or decode
        unit = getattr(getattr(processor, "video_processor", None), "temporal_patch_size", 1)
        sampling = dataclasses.replace(video.sampling, temporal_patch_size=unit)
        seconds = sampling.num_frames / video.fps
    else:
        assert isinstance(video, VideoSpec), video  # a chat request names a file
        try:
            check_native_size(video, limits.max_native_pixels, "--max-native-pixels")
            meta = probe(video)  # a header without the size: the decoder's (one frame decoded)
            check_pixels((meta.height, meta.width), limits.max_native_pixels,
                         "--max-native-pixels")
            sampling = rules.plan_sampling(video, meta)
        except ValueError as exc:
            raise ClientError(400, str(exc)) from None
        seconds = min(meta.duration, video.video_end or meta.duration) - \
            (video.video_start or 0)
    if request.mode.vit_split:  # every rank encodes its own temporal patches
        try:
            patch_ranges(sampling.num_patches, world_size)
        except ValueError as exc:
            least = world_size * sampling.temporal_patch_size
            hint = (f"; frames sent as images: send at least {least}, or use a mode in which "
                    "every rank encodes every frame (no_vit_split)"
                    if isinstance(video, DecodedVideo) else "")
            raise ClientError(400, f"{exc}{hint}") from None
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
            "width": sampling.resized_width,
            **({} if meta is None else decode_work(meta, sampling, world_size))}


