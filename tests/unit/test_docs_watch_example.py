"""The "Standing questions" example (docs/streams.md) opens a stream whose frames the
shipped model can see: its 56x56 frames stay 56x56 (the size ``needle-tiny`` was trained on),
where the example used to leave them to the one-shot rule's default floor (336x336), and the
model then answered "yes" to every chunk. The example's own body is read from the docs page,
sized by the rule the server applies to it (the example was run against the server, its
output pasted below it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from apbv.serve.streams.budget import KVSizing
from apbv.synthetic.needles import FRAME_SIZE

ROOT = Path(__file__).resolve().parents[2]
NEEDLE_TINY = ROOT / "apbv" / "assets" / "needle-tiny"


def _example_open_body() -> dict:
    text = (ROOT / "docs" / "streams.md").read_text()
    section = text[text.index("\n## Standing questions"):]
    block = section[section.index("```python"):]
    block = block[:block.index("\n```", 10)]
    found = re.search(r'api\.post\("/streams", json=(\{.*?\})\)', block, re.S)
    assert found is not None, "the example opens no stream"
    return ast.literal_eval(found.group(1))


def test_the_docs_watch_example_keeps_the_trained_frame_size():
    body = _example_open_body()
    sizing = KVSizing.of_checkpoint(str(NEEDLE_TINY), 4, 2, 16)
    size = sizing.frame_size(body["height"], body["width"], min_pixels=body.get("min_pixels"),
                             max_pixels=body.get("max_pixels"))
    assert (body["height"], body["width"]) == (FRAME_SIZE, FRAME_SIZE), body
    assert size == (FRAME_SIZE, FRAME_SIZE), f"the example's frames become {size}"
