"""A question about a live stream is a Request like a one-shot one: refused by the same checks
with the same message, fingerprinted field by field (the stream's id and freshness; no file
read), and built from a config the same way."""

from __future__ import annotations

import pytest
import torch

from apbv.config import load_config
from apbv.engine.request import MAX_QUESTION_CHARS, Request, StreamRef
from apbv.video import DecodedVideo

ONE_SHOT = DecodedVideo(torch.zeros(4, 3, 28, 28, dtype=torch.uint8), 2.0)

BAD = [
    ({"question": "x" * (MAX_QUESTION_CHARS + 1)}, "characters; the limit is"),
    ({"question": "  "}, "the question must be a non-empty string"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"choices": ("yes",)}, "choices must hold"),
    ({"choices": ("yes", "yes")}, "duplicates choice 0"),
    ({"stop_texts": ("x" * 65,)}, "stop must be a string or a list"),
    ({"choices": ("yes", "no"), "stop_texts": (".",)}, "give one or the other"),
    ({"system": "y" * (MAX_QUESTION_CHARS + 1)}, "the system text has"),
]


@pytest.mark.parametrize(("change", "message"), BAD, ids=[m for _, m in BAD])
def test_a_stream_ask_is_refused_as_a_one_shot_question(change: dict, message: str) -> None:
    fields = {"question": "What colour is the square? <|im_end|>", "mode": "exact", **change}
    with pytest.raises(ValueError) as one_shot:
        Request(video=ONE_SHOT, **fields)
    for ref in (StreamRef("s"), StreamRef("s", fresh=True)):
        with pytest.raises(ValueError) as asked:
            Request(video=ref, **fields)
        assert str(asked.value) == str(one_shot.value) and message in str(asked.value), (
            str(asked.value), str(one_shot.value))


def test_a_stream_ask_is_fingerprinted_by_its_stream_and_freshness() -> None:
    held = Request(video=StreamRef("a"), question="Q?", mode="exact").fingerprint()
    assert held["video.stream_id"] == "'a'" and held["video.fresh"] == "False"
    assert "video.size" not in held  # no file to read
    fresh = Request(video=StreamRef("a", fresh=True), question="Q?", mode="spava").fingerprint()
    other = Request(video=StreamRef("b"), question="Q?", mode="exact").fingerprint()
    assert {k for k in held if held[k] != fresh[k]} == {"video.fresh", "mode"}
    assert {k for k in held if held[k] != other[k]} == {"video.stream_id"}


def test_a_stream_ref_names_what_is_wrong() -> None:
    for bad, text in (("", "non-empty string"), (3, "non-empty string")):
        with pytest.raises(ValueError, match=text):
            StreamRef(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fresh must be true or false"):
        StreamRef("s", fresh="yes")  # type: ignore[arg-type]


def test_from_config_takes_a_stream_with_the_configs_attention_settings() -> None:
    cfg = load_config("tiny_cpu", ["attention.anchor_len=8", "attention.passing_len=4"])
    request = Request.from_config(cfg, StreamRef("s", fresh=True), "Q?", mode="spava",
                                  max_new_tokens=3, choices=None)
    assert request.video == StreamRef("s", fresh=True) and request.mode.name == "spava"
    assert (request.anchor_len, request.passing_len, request.max_new_tokens) == (8, 4, 3)
