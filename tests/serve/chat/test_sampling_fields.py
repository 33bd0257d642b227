"""The sampling fields at their documented edges: tiny temperature and top_p are a 400 naming
the field (never the ranks' 500), seeds reach 2**63 - 1 through the strict JSON reader,
``max_tokens`` and ``max_completion_tokens`` must agree, and every accepted setting draws a
token from any finite logits."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")

from apbv.engine.sampling import MAX_SEED, MIN_TEMPERATURE, MIN_TOP_P, Sampling  # noqa: E402
from apbv.openai.bodies import decode_json  # noqa: E402
from apbv.openai.policy import ClientError, Limits, MediaPolicy  # noqa: E402


@pytest.fixture
def chat(tmp_path: Path):
    """parse_chat of the JSON text of a body with ``fields`` (read by the server's reader)."""
    from apbv.config import load_config
    from apbv.openai.chat import parse_chat

    (tmp_path / "clip.mp4").write_bytes(b"x")  # parse_chat does not open it
    cfg, policy = load_config("tiny_cpu"), MediaPolicy((str(tmp_path),))
    messages = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": (tmp_path / "clip.mp4").as_uri()}},
        {"type": "text", "text": "what?"}]}]

    def parse(raw_fields: str = ""):
        text = json.dumps({"messages": messages})[:-1] + (f", {raw_fields}}}" if raw_fields
                                                          else "}")
        return parse_chat(decode_json(text.encode()), cfg, Limits(), policy, "m")
    return parse


def _refusal(chat, raw: str) -> ClientError:
    with pytest.raises(ClientError) as info:
        chat(raw)
    assert info.value.status == 400, info.value.message
    return info.value


@pytest.mark.parametrize("raw, param", [
    ('"temperature": 1e-300, "seed": 1', "temperature"),
    ('"temperature": 1e-38, "seed": 1', "temperature"),
    ('"temperature": 1, "top_p": 1e-46, "seed": 1', "top_p"),
    ('"temperature": 1, "top_p": 1e-9, "seed": 1', "top_p"),
])
def test_tiny_temperature_and_top_p_are_a_400_naming_the_field(chat, raw: str, param: str):
    error = _refusal(chat, raw)
    assert error.param == param and param in error.message, error.message
    assert "1e-05" in error.message or "1e-08" in error.message, error.message


@pytest.mark.parametrize("temperature, top_p", [
    (MIN_TEMPERATURE, 1.0), (MIN_TEMPERATURE, MIN_TOP_P), (2.0, MIN_TOP_P), (1.0, 0.5)])
def test_every_accepted_setting_draws_a_token(temperature: float, top_p: float):
    """Logits far apart (as a confident model's are): the division by the smallest temperature
    and the smallest top_p's cut keep the likeliest token, with no inf/NaN on the way."""
    logits = torch.linspace(-3e4, 3e4, 1000)
    logits[17] = 4e4
    token = Sampling(temperature=temperature, top_p=top_p, seed=5).pick(logits, step=0)
    assert token.item() == 17, (temperature, top_p, token)
    flat = Sampling(temperature=temperature, top_p=top_p, seed=5).pick(torch.zeros(50), 0)
    assert 0 <= flat.item() < 50


def test_the_largest_documented_seed_is_accepted(chat):
    call = chat(f'"temperature": 1, "seed": {MAX_SEED}')
    assert call.request.sampling.seed == MAX_SEED == 2**63 - 1
    error = _refusal(chat, f'"temperature": 1, "seed": {MAX_SEED + 1}')
    assert error.param == "seed" and "2**63 - 1" in error.message, error.message
    assert math.log10(MAX_SEED + 1) < 19, "a seed one past the range still has 19 digits"


def test_max_tokens_and_max_completion_tokens_must_agree(chat):
    error = _refusal(chat, '"max_tokens": 4, "max_completion_tokens": 2000')
    assert "max_completion_tokens and max_tokens differ" in error.message, error.message
    assert chat('"max_tokens": 4, "max_completion_tokens": 4').request.max_new_tokens == 4
    assert chat('"max_completion_tokens": 3').request.max_new_tokens == 3
