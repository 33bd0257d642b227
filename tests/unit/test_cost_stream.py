"""A live stream's predicted seconds (:func:`apbv.cost.stream.stream_seconds`): the appends' load
grows with the frame rate, the frame size and the held window, is the sum of its vision and
prefill parts, and an ask grows with its question, choices and window."""

from __future__ import annotations

import pytest

from apbv import cost
from apbv.cost.hardware import Machine
from apbv.cost.schedule import vision_cost
from apbv.cost.stream import _prefill_s, stream_seconds

DIMS, HW = cost.preset_dims("qwen2.5-vl-3b"), cost.hardware("cpu")
BASE = dict(frame_tokens=64, fps=2.0, held_tokens=4096, world_size=2, chunk_frames=4,
            question_tokens=20, choice_tokens=(1, 1))


def _cost(**change):
    return stream_seconds(DIMS, HW, **{**BASE, **change})


def test_the_load_grows_with_fps_frame_size_and_window():
    base = _cost()
    assert 0 < base.append_load
    assert _cost(fps=4.0).append_load == pytest.approx(2 * base.append_load)  # twice the chunks
    assert _cost(frame_tokens=256).append_load > base.append_load
    assert _cost(frame_tokens=256).vision_s > base.vision_s
    assert _cost(held_tokens=32768).prefill_s > base.prefill_s
    assert _cost(held_tokens=32768).vision_s == base.vision_s  # the tower sees the chunk only
    assert _cost(held_tokens=32768).ask_s > base.ask_s
    assert _cost(question_tokens=200).ask_s > base.ask_s
    assert _cost(choice_tokens=(1, 1, 1, 1)).ask_s > base.ask_s
    assert _cost(question_tokens=200).append_load == base.append_load


def test_the_load_is_the_sum_of_its_parts():
    c = _cost()
    m = Machine(HW, HW.dtype_bytes)
    chunk_s = BASE["chunk_frames"] / BASE["fps"]
    vision, _ = vision_cost(DIMS, 2, cost.squarest_grid(64), m)  # 4 frames: 2 temporal units
    assert c.vision_s == pytest.approx(vision / chunk_s)
    assert c.prefill_s == pytest.approx(_prefill_s(DIMS, m, 2 * 64, 2 * 4096) / chunk_s)
    assert c.append_load == pytest.approx(c.vision_s + c.prefill_s)
    head = m.matmuls(1, [(DIMS.hidden, DIMS.vocab)])
    assert c.ask_s == pytest.approx(_prefill_s(DIMS, m, 22, 2 * 4096) + 2 * head)


@pytest.mark.parametrize("change, name", [(dict(fps=0.0), "fps"),
                                          (dict(chunk_frames=0), "chunk_frames"),
                                          (dict(world_size=0), "world_size"),
                                          (dict(held_tokens=-1), "held_tokens"),
                                          (dict(choice_tokens=(1, -1)), "choice_tokens")])
def test_bad_figures_are_refused_by_name(change, name):
    with pytest.raises(ValueError, match=name):
        _cost(**change)


def test_a_keep_rate_scales_the_appends_and_not_the_ask():
    base = _cost(chunk_frames=8)  # 4 temporal units per append
    assert _cost(chunk_frames=8, keep_rate=1.0) == base  # 1: the unpruned figures, exactly
    half, tenth = _cost(chunk_frames=8, keep_rate=0.5), _cost(chunk_frames=8, keep_rate=0.1)
    assert half.vision_s == pytest.approx(0.5 * base.vision_s, rel=0.1), (half, base)
    assert half.prefill_s == pytest.approx(0.5 * base.prefill_s, rel=0.1), (half, base)
    assert tenth.append_load == pytest.approx(0.1 * base.append_load, rel=0.2), (tenth, base)
    assert half.ask_s == base.ask_s  # the held window is priced whole
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"keep_rate must be in \(0, 1\]"):
            _cost(keep_rate=bad)
