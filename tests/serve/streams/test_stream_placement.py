"""Which replica a new live stream goes to (:func:`apbv.serve.ranks.placement.place_stream`, and the
registry over two stand-in replicas, no ranks): the one whose streams' appends and watches take
the least of its time, among those whose memory budget holds it; ties to the fewest bytes
held; none holding it is the 507 with the figures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("fastapi")

from apbv.openai.policy import ClientError, Limits, MediaPolicy  # noqa: E402
from apbv.serve.app import live_streams  # noqa: E402
from apbv.serve.front.front import Front  # noqa: E402
from apbv.serve.front.metrics import Metrics  # noqa: E402
from apbv.serve.ranks.placement import ReplicaLoad, place_stream  # noqa: E402
from apbv.serve.scheduler.admission import Admission  # noqa: E402
from apbv.serve.scheduler.replicas import Replica  # noqa: E402
from apbv.serve.streams.registry import StreamOptions  # noqa: E402
from apbv.serve.streams.routes import Streams  # noqa: E402
from apbv.serve.watches.state import StreamWatches, Watch  # noqa: E402
from tests.serve.streams.test_stream_bookkeeping import KIB, _add  # noqa: E402
from tests.unit.test_watch_budget import _watch  # noqa: E402


def test_the_least_busy_replica_with_room_takes_the_stream():
    loads = [ReplicaLoad(0, busy=0.9, held=10, queued=0), ReplicaLoad(1, busy=0.2, held=50,
                                                                       queued=3),
             ReplicaLoad(2, busy=0.1, held=95, queued=0)]
    assert place_stream(loads, need=10, budget=100) == 1  # 2 is least busy but full
    assert place_stream(loads, need=4, budget=100) == 2
    assert place_stream(loads, need=91, budget=100) is None
    even = [ReplicaLoad(0, 0.0, 20, 0), ReplicaLoad(1, 0.0, 10, 5), ReplicaLoad(2, 0.0, 10, 1)]
    assert place_stream(even, need=1, budget=100) == 2  # nothing measured: fewest bytes, queue


def _two_replicas() -> tuple[Streams, list[Replica]]:
    group = SimpleNamespace(pids=[], world_size=1)
    metrics = Metrics()
    replicas = [Replica(i, group, Admission(4), metrics, lambda _: None) for i in range(2)]
    for replica in replicas:
        replica.status = "ready"
    front = Front(None, Limits(), MediaPolicy(), "m", Metrics(), None)
    streams, _ = live_streams(front, replicas, StreamOptions(budget_bytes=100 * KIB))
    return streams, replicas


def test_a_stream_goes_where_appends_and_watches_take_the_least_time():
    streams, (zero, one) = _two_replicas()
    registry = streams.registry
    a = _add(streams, zero, "a")  # replica 0 holds one stream, 1 holds two
    b, c = _add(streams, one, "b"), _add(streams, one, "c")
    assert registry.place(10 * KIB) is zero  # nothing measured: the fewer bytes held
    a.append_load = 0.2  # a's appends take 0.2 s per s of footage ...
    watch: Watch = _watch("a", eval_s=0.5)  # ... and its watch 0.5 s per 1 s chunk
    streams.registry.listener.of["a"] = StreamWatches({watch.id: watch}, chunk_s=1.0)
    b.append_load = c.append_load = 0.1
    assert registry.time_share(zero) == pytest.approx(0.7)
    assert registry.time_share(one) == pytest.approx(0.2)
    assert registry.place(10 * KIB) is one  # busier by time, though it holds more bytes
    assert registry.place(85 * KIB) is zero  # only replica 0 has room for it
    with pytest.raises(ClientError) as exc:  # neither has: the emptiest one's figures
        registry.place(95 * KIB)
    assert exc.value.status == 507 and "least loaded replica hold 10.0 KiB" in exc.value.message
