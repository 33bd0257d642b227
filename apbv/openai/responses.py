"""The OpenAI response shapes of an answer: ``chat.completion`` bodies, streamed
``chat.completion.chunk`` events, usage and log-probabilities, with apbv's own ``apbv`` block
(TTFT and its stages in seconds, queue wait, token ids, the plan's lengths in tokens)."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from apbv.engine.request import Result
    from apbv.openai.chat import ChatCall
    from apbv.openai.detok import Tokenizer


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def usage(result: Result) -> dict[str, int]:
    prompt = result.context_len + result.query_len
    new = len(result.token_ids) + sum(len(o["token_ids"]) for o in result.others or ())
    return {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new}


def apbv_block(result: Result, queue_wait_s: float, replica: int = 0) -> dict[str, Any]:
    out = {"replica": replica, "ttft_s": result.ttft_s, "seconds": result.seconds,
           "mode": result.mode, "world_size": result.world_size, "context_len": result.context_len,
           "query_len": result.query_len, "anchor_len": result.anchor_len,
           "passing_len": result.passing_len, "frames": result.frames,
           "token_ids": list(result.token_ids), "queue_wait_s": queue_wait_s}
    for name, value in (("vision_cache_hit", result.vision_cache_hit),
                        ("choices", result.choices), ("snapped_frames", result.snapped_frames)):
        if value is not None:
            out[name] = value
    return out


def completion(call: ChatCall, cid: str, result: Result, queue_wait_s: float,
               replica: int = 0, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    out = answer(call.model, cid, result, queue_wait_s, replica, tokenizer)
    if call.ignored:
        out["apbv"]["ignored_fields"] = list(call.ignored)
    return out


def answer(model: str, cid: str, result: Result, queue_wait_s: float,
           replica: int = 0, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """A chat.completion body for ``result`` (also the answer of a live stream's ask); its
    log-probabilities, when the request asked for them, named by ``tokenizer``."""
    return {
        "id": cid, "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": result.answer},
                     "finish_reason": result.finish_reason,
                     "logprobs": logprobs(result.logprobs, tokenizer)}] + [
            {"index": i, "message": {"role": "assistant", "content": other["answer"]},
             "finish_reason": other["finish_reason"],
             "logprobs": logprobs(other["logprobs"], tokenizer)}
            for i, other in enumerate(result.others or (), start=1)],
        "usage": usage(result),
        "apbv": apbv_block(result, queue_wait_s, replica),
    }


def logprobs(records: list[dict[str, Any]] | None,
             tokenizer: Tokenizer | None) -> dict[str, Any] | None:
    """OpenAI's ``logprobs`` of a choice ({"content": [{"token", "logprob", "bytes",
    "top_logprobs": [...]}, ...]}, one entry per generated token) from a result's records
    (:meth:`apbv.engine.sampling.Sampling.record`); None when none were asked for."""
    if records is None or tokenizer is None:
        return None

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(r["id"], r["logprob"]),
                         "top_logprobs": [entry(i, lp) for i, lp in r["top"]]}
                        for r in records]}


def chunk(model: str, cid: str, delta: dict[str, Any], finish: str | None = None,
          logprobs: dict[str, Any] | None = None, **extra: object) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                         "logprobs": logprobs}],
            **extra}


def usage_chunk(model: str, cid: str, result: Result) -> dict[str, Any]:
    """The last event of a streamed answer that asked for usage
    (``stream_options.include_usage``): no choices, the usage."""
    return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "choices": [], "usage": usage(result)}
