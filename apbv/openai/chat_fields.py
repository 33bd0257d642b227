"""Every OpenAI and vLLM chat-completions field in one of three classes: acted on, harmless
and ignored (reported), or output-changing and not supported (400 naming it).

:data:`FIELDS` is the one table (``docs/compatibility.md`` shows it); :func:`classify` applies
it to a body. A field given as null, or with its neutral value (the value that changes
nothing: ``n: 1``, ``echo: false``, ``response_format: {"type": "text"}``), is as if absent.
An unsupported field is a ClientError(400) naming it (``param``) unless the server runs with
``--ignore-unsupported-fields``, which reports it as ignored instead; a field the table does
not know is reported as ignored (as vLLM tolerates unknown fields).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from apbv.openai.policy import ClientError

ACTED, IGNORED, UNSUPPORTED = "acted on", "ignored", "400"
"""The three classes (their spelling in the docs' table)."""
_ABSENT = object()


@dataclass(frozen=True)
class Field:
    """One request field: its name (``a.b`` for a key of object ``a``), its class, who
    defines it (``openai``, ``vllm`` or ``apbv``), what apbv does with it, and for an
    unsupported field a value that changes the output (the tests send it) and its neutral
    value (accepted as if absent)."""

    name: str
    kind: str
    origin: str
    note: str
    example: Any = None
    neutral: Any = _ABSENT


def _acted(name: str, origin: str, note: str) -> Field:
    return Field(name, ACTED, origin, note)


def _ignored(name: str, origin: str, note: str) -> Field:
    return Field(name, IGNORED, origin, note)


def _no(name: str, origin: str, note: str, example: Any, neutral: Any = _ABSENT) -> Field:
    return Field(name, UNSUPPORTED, origin, note, example, neutral)


FIELDS: tuple[Field, ...] = (
    # OpenAI's chat-completions fields.
    _acted("messages", "openai", "one user message (a video and text) and one system message"),
    _acted("model", "openai", "must name the served model (404 otherwise)"),
    _acted("max_tokens", "openai", "tokens generated at most"),
    _acted("max_completion_tokens", "openai", "max_tokens' new name (given both: must agree)"),
    _acted("temperature", "openai", "0: greedy; else sampled"),
    _acted("top_p", "openai", "nucleus sampling"),
    _acted("seed", "openai", "the same seed gives the same answer"),
    _acted("n", "openai", "1 .. 8 answers from one prefill (n > 1: not streamed)"),
    _acted("logprobs", "openai", "each token's log-probability"),
    _acted("top_logprobs", "openai", "alternatives per token (with logprobs)"),
    _acted("stream", "openai", "server-sent events"),
    _acted("stream_options", "openai", "include_usage; other keys reported as ignored"),
    _acted("stop", "openai", "texts that end the answer"),
    _acted("presence_penalty", "openai", "subtracted once from each answer token's logit"),
    _acted("frequency_penalty", "openai", "subtracted per occurrence in the answer"),
    _acted("logit_bias", "openai", "added to the named token ids' logits"),
    _ignored("user", "openai", "an end-user id"),
    _ignored("metadata", "openai", "stored-completion tags"),
    _ignored("store", "openai", "nothing is stored"),
    _ignored("service_tier", "openai", "one tier"),
    _ignored("parallel_tool_calls", "openai", "no tools are called"),
    _ignored("prompt_cache_key", "openai", "the vision cache is keyed by the video"),
    _ignored("safety_identifier", "openai", "an end-user id"),
    _acted("response_format", "openai", "json_object, json_schema: the answer follows it"),
    _no("tools", "openai", "tool calling", [{"type": "function", "function": {"name": "f"}}],
        []),
    _no("tool_choice", "openai", "tool calling", "required", "none"),
    _no("functions", "openai", "tool calling (old)", [{"name": "f"}], []),
    _no("function_call", "openai", "tool calling (old)", "auto", "none"),
    _no("audio", "openai", "audio output", {"voice": "alloy", "format": "wav"}),
    _no("modalities", "openai", "only text out", ["text", "audio"], ["text"]),
    _no("prediction", "openai", "predicted output", {"type": "content", "content": "x"}),
    _no("reasoning_effort", "openai", "no reasoning model", "high"),
    _no("verbosity", "openai", "no such control", "high"),
    _no("web_search_options", "openai", "no web search", {}),
    # vLLM's extra fields.
    _acted("top_k", "vllm", "sample among the k likeliest (0 or -1: all)"),
    _acted("ignore_eos", "vllm", "decoding goes on past EOS up to max_tokens"),
    _acted("min_tokens", "vllm", "EOS and stop texts wait for this many tokens"),
    _acted("repetition_penalty", "vllm", "answer tokens' logits divided (> 0) or multiplied"),
    _acted("guided_choice", "vllm", "closed vocabulary, scored exactly"),
    _acted("structured_outputs", "vllm", "choice: closed vocabulary; its other keys below"),
    _acted("mm_processor_kwargs", "vllm", "fps, nframes, max_pixels, video_pruning_rate; other "
           "keys reported"),
    _acted("media_io_kwargs", "vllm", "video.num_frames; other keys reported"),
    _ignored("request_id", "vllm", "the completion id is the server's"),
    _ignored("priority", "vllm", "first come, first served (deadlines: deadline_ms)"),
    _ignored("cache_salt", "vllm", "no shared prefix cache"),
    _ignored("kv_transfer_params", "vllm", "no disaggregated prefill"),
    _ignored("vllm_xargs", "vllm", "no plugins"),
    _ignored("guided_decoding_backend", "vllm", "one grammar engine (llguidance)"),
    _ignored("spaces_between_special_tokens", "vllm", "special tokens are left out"),
    _acted("structured_outputs.json", "vllm", "the answer follows the JSON schema"),
    _acted("structured_outputs.regex", "vllm", "the answer matches the regex"),
    _acted("structured_outputs.grammar", "vllm", "the answer follows the Lark or GBNF grammar"),
    _acted("structured_outputs.json_object", "vllm", "the answer is a JSON object"),
    _no("structured_outputs.structural_tag", "vllm", "structural tags (tool calls)", "{}"),
    _acted("guided_json", "vllm", "structured_outputs.json's old name"),
    _acted("guided_regex", "vllm", "structured_outputs.regex's old name"),
    _acted("guided_grammar", "vllm", "structured_outputs.grammar's old name"),
    _no("structural_tag", "vllm", "structural tags (tool calls)", "{}"),
    _no("guided_whitespace_pattern", "vllm", "the grammar engine's own whitespace", " *"),
    _no("best_of", "vllm", "one answer per request", 2, 1),
    _no("use_beam_search", "vllm", "no beam search", True, False),
    _no("length_penalty", "vllm", "beam search only", 0.5, 1),
    _no("min_p", "vllm", "not implemented", 0.1, 0),
    _no("stop_token_ids", "vllm", "not implemented (stop texts are)", [0], []),
    _no("include_stop_str_in_output", "vllm", "the answer is cut before a stop text", True,
        False),
    _no("skip_special_tokens", "vllm", "special tokens are always left out", False, True),
    _no("allowed_token_ids", "vllm", "not implemented", [0]),
    _no("bad_words", "vllm", "not implemented", ["x"], []),
    _no("prompt_logprobs", "vllm", "not implemented", 1),
    _no("truncate_prompt_tokens", "vllm", "prompts are refused, not cut", 8),
    _no("return_tokens_as_token_ids", "vllm", "logprobs give token text", True, False),
    _no("logits_processors", "vllm", "no plugins", ["x"], []),
    _no("echo", "vllm", "the answer only", True, False),
    _no("add_generation_prompt", "vllm", "always added", False, True),
    _no("continue_final_message", "vllm", "no assistant turn", True, False),
    _no("add_special_tokens", "vllm", "the model's chat template decides", True, False),
    _no("documents", "vllm", "no retrieval template", [{"text": "x"}], []),
    _no("chat_template", "vllm", "the model's own template", "{{ messages }}"),
    _no("chat_template_kwargs", "vllm", "the model's own template", {"x": 1}, {}),
    # apbv's own fields.
    _acted("mode", "apbv", "attention mode"),
    _acted("fps", "apbv", "frames sampled per second"),
    _acted("nframes", "apbv", "frames sampled in all"),
    _acted("max_pixels", "apbv", "pixel budget of a sampled frame"),
    _acted("deadline_ms", "apbv", "refuse (503) when the first token cannot come in time"),
    _acted("choice_set", "apbv", "closed vocabulary, scored exactly"),
    _acted("choices", "apbv", "choice_set's old name"),
    _acted("static_threshold", "apbv", "temporal pruning of static patches (docs/pruning.md)"),
    _acted("video_pruning_rate", "apbv", "vLLM's pruning rate in [0, 1) (docs/pruning.md)"),
)
BY_NAME = {f.name: f for f in FIELDS}
assert len(BY_NAME) == len(FIELDS), "a field is listed twice"


def _value(body: dict, name: str) -> Any:
    head, _, key = name.partition(".")
    value = body.get(head, _ABSENT)
    if key:
        value = value.get(key, _ABSENT) if isinstance(value, dict) else _ABSENT
    return value


def classify(body: dict, lenient: bool = False) -> list[str]:
    """The body's fields reported as ignored: the harmless ones, those the table does not know
    and (``lenient``) the unsupported ones; without ``lenient`` an unsupported field given with
    a value other than its neutral one is a ClientError(400) naming it."""
    ignored = []
    for spec in FIELDS:
        if spec.kind == ACTED:
            continue
        value = _value(body, spec.name)
        if value is _ABSENT or value is None or (spec.neutral is not _ABSENT and
                                                 value == spec.neutral):
            continue
        if spec.kind == UNSUPPORTED and not lenient:
            raise ClientError(400, f"{spec.name} is not supported ({spec.note}): it would change "
                                   "the answer, so it is refused rather than ignored (the server "
                                   "flag --ignore-unsupported-fields ignores it instead)",
                              param=spec.name)
        ignored.append(spec.name)
    outputs = body.get("structured_outputs")
    unknown = sorted(k for k in outputs if k != "choice" and
                     f"structured_outputs.{k}" not in BY_NAME) \
        if isinstance(outputs, dict) else []
    if unknown and not lenient:  # a structured-output key changes the answer
        raise ClientError(400, f"structured_outputs.{unknown[0]} is not supported: only "
                               "structured_outputs.choice (a closed vocabulary)",
                          param=f"structured_outputs.{unknown[0]}")
    ignored += [f"structured_outputs.{k}" for k in unknown]
    return sorted(set(ignored) | {k for k in body if k not in BY_NAME})
