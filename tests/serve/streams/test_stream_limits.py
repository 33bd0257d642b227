"""Live streams without ranks: the idle clock stops while an operation on the stream is queued
or running, a failed capture is the stream's top-level error, timestamps are bounded (finite,
within +-1e10 s, each at most an hour after the previous), and a window too wide for floats
reserves the context, not a 500."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time

import numpy as np
import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("fastapi")

from apbv.capture import Capture, Source  # noqa: E402
from apbv.engine.stream_plan import MAX_TIMESTAMP_GAP_S, check_timestamps  # noqa: E402
from apbv.openai.frames import parse_push  # noqa: E402
from apbv.openai.policy import ClientError, Limits  # noqa: E402
from apbv.serve.scheduler.admission import Admission  # noqa: E402
from apbv.serve.streams.budget import KVSizing  # noqa: E402
from tests.serve.streams.test_stream_bookkeeping import _add, _asked, _streams  # noqa: E402


async def _kept_while(streams, name: str, seconds: float) -> bool:
    """Whether stream ``name`` is still open after ``seconds`` of the sweep running."""
    sweeper = asyncio.create_task(streams.registry.sweep())
    await asyncio.sleep(seconds)
    sweeper.cancel()
    return name in streams.registry.live


async def _closed_after(streams, name: str, limit_s: float = 3.0) -> float:
    """Seconds until the sweep closes stream ``name`` (at most ``limit_s``)."""
    start = time.monotonic()
    sweeper = asyncio.create_task(streams.registry.sweep())
    while name in streams.registry.live and time.monotonic() - start < limit_s:
        await asyncio.sleep(0.02)
    sweeper.cancel()
    return time.monotonic() - start


def test_a_queued_or_running_operation_stops_the_idle_clock():
    """A client waiting on a long ask (here: its job queued, no dispatcher) is using the
    stream: the sweep leaves it open however long that takes, and its idle clock starts
    again when the job ends."""
    async def scenario() -> tuple[bool, bool, float]:
        streams, replica = _streams(idle_s=0.2)
        replica.admission = Admission(8)  # no dispatcher: the job waits until we end it
        live = _add(streams, replica, "s", idle_for=5.0)  # last touched long ago
        job = streams.registry.admit(live, _asked("What is shown?"))
        queued = await _kept_while(streams, "s", 0.8)  # 8 sweeps, 4x the idle limit
        replica.admission.heap.clear()
        replica.admission.running = job  # now it runs
        running = await _kept_while(streams, "s", 0.5)
        job.future.set_result(({"answer": "a"}, 0.0))
        return queued, running, await _closed_after(streams, "s")

    queued, running, closed_after = asyncio.run(scenario())
    assert queued and running
    assert 0.2 <= closed_after < 2.0, closed_after  # the clock ran again from the job's end


def test_a_request_being_handled_or_a_dropped_job_and_the_idle_clock():
    """A request still being read or parsed stops the clock too; a job taken out of the
    queue unrun (its client went away while it waited) ends, and the clock runs again."""
    async def scenario() -> tuple[bool, float, float]:
        streams, replica = _streams(idle_s=0.2)
        replica.admission = Admission(8)
        live = _add(streams, replica, "s", idle_for=5.0)
        done = streams.registry.busy(live)  # a push's body being parsed
        handled = await _kept_while(streams, "s", 0.6)
        done()
        after_request = await _closed_after(streams, "s")
        live = _add(streams, replica, "t", idle_for=5.0)
        job = streams.registry.admit(live, _asked("What is shown?"), sse=True)
        assert await _kept_while(streams, "t", 0.4)
        assert replica.admission.drop(job)  # what the SSE writer does for a gone client
        return handled, after_request, await _closed_after(streams, "t")

    handled, after_request, after_drop = asyncio.run(scenario())
    assert handled and 0.2 <= after_request < 2.0, (handled, after_request)
    assert after_drop < 2.0, after_drop


class _Failing(Source):
    def frames(self, stop: threading.Event):
        yield None
        raise ValueError("followed video '/m/a.ts' failed while decoding: Invalid data")


def test_a_failed_capture_is_the_streams_top_level_error():
    streams, replica = _streams()
    live = _add(streams, replica, "s")
    live.capture = Capture(_Failing(), max_pixels=56 * 56)
    try:
        deadline = time.monotonic() + 10
        while not live.capture.stats()["ended"]:
            assert time.monotonic() < deadline, "the capture did not end"
            time.sleep(0.01)
        out = streams.registry.summary(live)
    finally:
        live.capture.close()
    assert out["capture"]["error"].endswith("failed while decoding: Invalid data")
    assert out["error"] == "the source failed: followed video '/m/a.ts' failed while " \
                           "decoding: Invalid data"


def _png() -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (28, 28), "red").save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def _push(timestamps: list | None, last_ts: float | None, fps: float = 2.0):
    body = {"frames": [_png()] * (1 if timestamps is None else len(timestamps))}
    if timestamps is not None:
        body["timestamps"] = timestamps
    return parse_push(body, Limits(), None, None, last_ts, fps)


@pytest.mark.parametrize("timestamps, last_ts, text", [
    ([1e308], None, "timestamps must be within +-1e+10 s, got 1e+308"),
    ([-2e10], None, "timestamps must be within +-1e+10 s, got -2e+10"),
    ([5.0, 3605.5], None, "timestamps may jump at most 3600 s from the previous frame: 3605.5 "
                          "follows 5.0, 3600.5 s later (after a longer pause, open a new stream)"),
    ([3601.0], 0.5, "may jump at most 3600 s from the previous frame: 3601.0 follows 0.5"),
    ([1.0, 0.5], None, "timestamps must increase: 0.5 follows 1.0"),
])
def test_pushed_timestamps_are_bounded_with_the_bound_named(timestamps, last_ts, text):
    with pytest.raises(ClientError) as exc:
        _push(timestamps, last_ts)
    assert exc.value.status == 400 and text in exc.value.message, exc.value.message


def test_bounded_timestamps_pass_and_later_pushes_go_on():
    """Unix times fit, and so does a pause of exactly the bound; frames without timestamps
    follow at 1 / fps (what a 1e308 stamp used to make impossible: 1e308 + 0.5 == 1e308)."""
    first = _push([1.7e9, 1.7e9 + MAX_TIMESTAMP_GAP_S], None).timestamps
    assert first == [1.7e9, 1.7e9 + 3600.0]
    assert _push(None, first[-1]).timestamps == [first[-1] + 0.5]
    # The engine's check takes what a Python caller may pass: numpy and torch scalars.
    assert check_timestamps([np.float32(0.5), np.float64(1.0)], 0.0) == [0.5, 1.0]
    with pytest.raises(ValueError, match="finite numbers of seconds, got 'x'"):
        check_timestamps(["x"], None)
    with pytest.raises(ValueError, match="finite numbers of seconds, got nan"):
        check_timestamps([float("nan")], None)


def test_a_window_too_wide_for_floats_reserves_the_context_not_an_overflow():
    sizing = KVSizing(kv_bytes_per_token=512, max_positions=4096, world_size=2,
                      max_frames_per_push=8)
    context = sizing.need(4, 2.0, None, None)  # no window: the context over the ranks
    assert context == 512 * (2048 + 4 * 4)
    assert sizing.need(4, 1e308, 1e308, None) == context  # window_s x fps is inf
    assert sizing.need(4, 2.0, 1e300, None) == context
    assert sizing.need(4, 2.0, None, 10**30) == context  # the engine never holds more
    # A window inside the context: 8 s at 2 fps, 9 patches of 4 tokens over 2 ranks, + a push.
    assert sizing.need(4, 2.0, 8.0, None) == 512 * (18 + 16)
