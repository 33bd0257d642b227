"""apbv.serve.ranks.ops: each typed operation reaches the engine method it names, with its fields;
only an answer (Generate) streams tokens and takes a stop; anything else is refused naming the
operations there are."""

from __future__ import annotations

import pytest
import torch

from apbv.engine.request import Request, StreamRef
from apbv.engine.stream_plan import StreamSpec
from apbv.serve.ranks.ops import Append, CloseStream, DescribeStream, Generate, OpenStream, apply


class _Engine:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def generate(self, request, on_token=None, stop=None):
        self.calls.append(("generate", request, on_token, stop))
        return "result"

    def open_stream(self, stream_id, spec):
        self.calls.append(("open_stream", stream_id, spec))
        return "opened"

    def append(self, stream_id, frames, timestamps, held=()):
        self.calls.append(("append", stream_id, frames, timestamps, held))
        return "appended"

    def close_stream(self, stream_id):
        self.calls.append(("close_stream", stream_id))

    def describe_stream(self, stream_id):
        self.calls.append(("describe_stream", stream_id))
        return "described"


def test_each_op_reaches_its_engine_method() -> None:
    engine, on_token, stop = _Engine(), print, bool
    request = Request(video=StreamRef("s"), question="Q?", mode="exact", max_new_tokens=5)
    spec = StreamSpec(height=28, width=28)
    frames = torch.zeros(2, 3, 28, 28, dtype=torch.uint8)
    ops = [Generate(request), OpenStream("s", spec), Append("s", frames, (0.0, 0.5)),
           DescribeStream("s"), CloseStream("s")]
    assert [apply(op, engine, on_token, stop) for op in ops] == [
        "result", "opened", "appended", "described", None]
    assert engine.calls == [("generate", request, on_token, stop), ("open_stream", "s", spec),
                            ("append", "s", frames, (0.0, 0.5), ()), ("describe_stream", "s"),
                            ("close_stream", "s")]
    assert [op.answers for op in ops] == [True, False, False, False, False]
    assert [op.max_tokens for op in ops] == [5, 0, 0, 0, 0]


def test_an_unknown_op_is_refused_naming_the_ops() -> None:
    with pytest.raises(ValueError, match="unknown operation str; allowed: Generate, OpenStream, "
                                         "Append, CloseStream, DescribeStream"):
        apply("open", _Engine())  # type: ignore[arg-type]
