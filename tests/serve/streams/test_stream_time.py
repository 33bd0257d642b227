"""The time budget of a replica's streams without ranks (:mod:`apbv.serve.streams.pricing` over a
stand-in replica, the cost model on the ``cpu`` preset with Qwen2.5-VL-3B's sizes): a stream
the replica can sustain is opened, one it cannot is refused (429) with its figures, measured
appends scale the predictions, and a watch is refused from its prediction before anything was
measured on its stream; static cameras (temporal pruning) are priced at their measured keep
rate and measured over their recent appends, so a replica admits more of them."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("fastapi")

from apbv import cost  # noqa: E402
from apbv.config import load_config  # noqa: E402
from apbv.engine.stream_plan import Appended  # noqa: E402
from apbv.openai.policy import ClientError, Limits  # noqa: E402
from apbv.serve.app import live_streams  # noqa: E402
from apbv.serve.front.metrics import Metrics  # noqa: E402
from apbv.serve.scheduler.admission import Admission  # noqa: E402
from apbv.serve.scheduler.replicas import Replica  # noqa: E402
from apbv.serve.streams.budget import GIB, KVSizing  # noqa: E402
from apbv.serve.streams.pricing import (  # noqa: E402
    RECENT_APPENDS,
    RecentAppends,
    StreamPricing,
    combined_load,
    priced_keep_rate,
)
from apbv.serve.streams.registry import StreamOptions  # noqa: E402
from apbv.serve.streams.routes import Streams  # noqa: E402
from apbv.serve.watches.state import StreamWatches, Watch  # noqa: E402

DIMS = cost.preset_dims("qwen2.5-vl-3b")
SMALL = {"fps": 0.5, "max_pixels": 112 * 112, "window_s": 60}
"""About 0.24 s of appends per second of footage on the cpu preset: admitted."""
BIG = {"fps": 2, "max_pixels": 448 * 448, "window_s": 60}
"""About 23 s per second of footage: more than a whole replica."""


def _streams() -> tuple[Streams, Replica]:
    replica = Replica(0, SimpleNamespace(pids=[], world_size=2), Admission(4), Metrics(),
                      lambda _: None)
    replica.status = "ready"

    async def read_json(request):
        return request

    front = SimpleNamespace(metrics=Metrics(), authorize=lambda _: None, read_json=read_json,
                            cfg=load_config("tiny_cpu"), limits=Limits(), model_name="m",
                            webhook_hosts=())
    pricing = StreamPricing(DIMS, cost.hardware("cpu"), 2, 8, lambda text: len(text.split()))
    options = StreamOptions(budget_bytes=GIB, sizing=KVSizing.of_dims(DIMS, 32768, 2, 2, 8),
                            pricing=pricing)
    return live_streams(front, [replica], options)[0], replica


def _open(streams: Streams, body: dict) -> dict:
    response = asyncio.run(streams.open(body))  # the stand-in server reads the body as is
    assert response.status_code == 201
    return json.loads(response.body)


def _refused(call, *texts: str) -> str:
    with pytest.raises(ClientError) as exc:
        call()
    assert exc.value.status == 429, exc.value.message
    for text in texts:
        assert text in exc.value.message, (text, exc.value.message)
    return exc.value.message


def test_a_stream_is_opened_where_it_fits_and_refused_with_its_figures_where_not():
    streams, replica = _streams()
    small = streams.registry.live[_open(streams, SMALL)["id"]]
    assert small.predicted is not None and 0.2 < small.predicted.append_load < 0.3
    assert streams.registry.time_share(replica) == pytest.approx(small.predicted.append_load)
    message = _refused(lambda: _open(streams, BIG),
                       "replica 0 cannot sustain this stream", "at 2 fps, 200704 pixels per "
                       "frame and window window_s 60", "the streams there already take 24%",
                       "lower fps, the frame size")
    assert len(streams.registry.live) == 1, message  # nothing held for the refused one


def test_measured_appends_scale_the_predictions():
    assert combined_load([(None, 0.2)]) == (pytest.approx(0.2), 1.0)  # nothing measured
    assert combined_load([(0.6, 0.2), (None, 0.1), (0.05, None)]) == \
        (pytest.approx(0.6 + 3 * 0.1 + 0.05), pytest.approx(3.0))
    streams, replica = _streams()
    first = streams.registry.live[_open(streams, SMALL)["id"]]
    assert first.predicted is not None
    _open(streams, SMALL)  # two predicted at about 0.24 each fit
    streams.registry.forget(streams.registry.live[[k for k in streams.registry.live
                                                   if k != first.id][0]])
    first.append_s = (0.0, 1.0)  # its appends measured at 3x the prediction
    first.append_load = 3 * first.predicted.append_load
    _refused(lambda: _open(streams, SMALL), "x 3.00, its streams' measured / predicted")


WATCH = {"question": "Is there a flash in the last second?", "choices": ["yes", "no"]}


def _watch(streams: Streams, stream_id: str) -> dict:
    """A watch created through the route (the stand-in server reads the body as is)."""
    response = asyncio.run(streams.registry.listener.create(stream_id, WATCH))
    assert response.status_code == 201
    return json.loads(response.body)


def test_a_watch_is_refused_from_its_prediction_before_anything_was_measured():
    streams, replica = _streams()
    small = _open(streams, SMALL)["id"]
    created = _watch(streams, small)
    first = streams.registry.listener.of[small].watches[created["id"]]
    assert first.predicted is not None and first.predicted[1] == 16.0  # 8 frames at 0.5 fps
    assert 0.5 < first.predicted[0] < 1.0  # about 0.7 s per 16 s of footage: admitted
    streams.registry.forget(streams.registry.live[small])
    busy = _open(streams, {**SMALL, "fps": 2})["id"]  # appends about 0.97 of the replica
    _refused(lambda: _watch(streams, busy), "cannot sustain this watch", "per 4 s of footage",
             "the streams' appends 97% (its seconds predicted)")
    measured = Watch(first.request, first.rule, None, id="m", stream=busy, eval_s=0.02)
    streams.registry.listener.of[busy] = StreamWatches({"m": measured}, chunk_s=4.0)
    _watch(streams, busy)  # measured on the stream: 0.02 s per 4 s fits


def test_static_cameras_are_priced_at_their_keep_rate_and_more_are_admitted():
    recent = RecentAppends()
    assert (recent.keep_rate, recent.load) == (None, None) and priced_keep_rate(None) == 1.0
    first = Appended(0, 0, 4, 0, patches=1, kept=1)  # the always kept first patch: alone,
    assert recent.add(first, 0.5, 0.5) == 1.0  # it stands for the stream; replaced by the next
    for i in range(RECENT_APPENDS + 4):  # the oldest 4 (every patch kept) leave the window
        kept = 4 if i < 4 else i % 2
        recent.add(Appended(None, None, 16 * kept, 0, patches=4, kept=kept),
                   0.4 if i < 4 else 0.05 * (i % 2), 16.0)
    assert recent.keep_rate == pytest.approx(8 / 64) and recent.load == pytest.approx(
        0.4 / 256) and recent.tokens == 4 + 16 * 24, recent
    assert recent.mostly_pruned and recent.priced == pytest.approx(8 / 64)
    assert priced_keep_rate(0.0) == 0.05 and priced_keep_rate(0.3) == 0.3
    streams, replica = _streams()
    unpruned = 0
    while unpruned < 8:  # every patch kept: about 0.24 each, 4 fit
        try:
            _open(streams, SMALL)
        except ClientError:
            break
        unpruned += 1
    assert unpruned == 4, unpruned
    streams, replica = _streams()
    static = 0
    while static < 8:  # --max-streams
        live = streams.registry.live[_open(streams, SMALL)["id"]]
        full = live.predicted
        assert full is not None
        for _ in range(RECENT_APPENDS):  # one patch in ten kept, measured at that share
            appended = Appended(None, None, 0, 0, patches=10, kept=1)
            live.append_load = live.recent.add(appended, 0.1 * full.append_load * 20.0, 20.0)
        live.append_s = (0.0, 0.1)
        live.predicted = streams.registry.price(live.spec, live.sized, live.pixels[1],
                                                keep_rate=live.recent.priced)
        assert live.predicted is not None and live.predicted.append_load == pytest.approx(
            0.1 * full.append_load, rel=0.2), (live.predicted, full)
        static += 1
    assert static >= 2 * unpruned, static  # all 8 the stream limit allows
    # their measured load counts; being mostly pruned, they do not set the scale
    assert streams.registry.appends(replica) == (pytest.approx(
        8 * 0.1 * full.append_load), 1.0)
