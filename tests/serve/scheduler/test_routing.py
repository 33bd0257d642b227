"""The replica router, the hand-over of a rebuilding replica's queue and the remote-media
policy, without a server."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")

from apbv.openai.policy import ClientError, MediaPolicy, remote_url  # noqa: E402
from apbv.serve.front.metrics import Metrics  # noqa: E402
from apbv.serve.scheduler.admission import Admission  # noqa: E402
from apbv.serve.scheduler.replicas import Replica, overall_status, pick  # noqa: E402
from apbv.video import (
    VideoSpec,  # noqa: E402
    video_identity,  # noqa: E402
)


def _replicas(n: int) -> list[Replica]:
    metrics = Metrics()
    group = SimpleNamespace(pids=[], world_size=1)
    replicas = [Replica(i, group, Admission(2), metrics, lambda _: None) for i in range(n)]
    for r in replicas:
        r.status = "ready"
    return replicas


def test_cache_affinity_then_least_loaded_then_degraded(tmp_path: Path):
    video = tmp_path / "v.mp4"
    video.write_bytes(b"x")
    request = SimpleNamespace(video=VideoSpec(str(video), nframes=8))
    a, b, c = _replicas(3)
    a.admission.running = object()  # a runs one, b one waiting: c is the least loaded
    b.admission.heap.append(((0.0, 0), None))
    assert pick([a, b, c], request, affinity=True) is c
    b.remember(video_identity(request.video))
    assert pick([a, b, c], request, affinity=True) is b  # its vision cache holds the video
    assert pick([a, b, c], request, affinity=False) is c
    other = SimpleNamespace(video=VideoSpec(str(video), nframes=16))  # other sampling: no hit
    assert pick([a, b, c], other, affinity=True) is c
    os.utime(video, ns=(1, 1))  # a rewritten file is another identity
    assert pick([a, b, c], request, affinity=True) is c
    c.status = "degraded"
    assert pick([a, b, c], other, affinity=True) is a  # a, b: load 1 each, the lower index
    assert overall_status([a, b, c]) == "ready"
    a.status = b.status = "degraded"
    assert pick([a, b, c], other, affinity=True) is c and overall_status([a, b, c]) == "degraded"
    a.status, b.status, c.status = "starting", "failed", "starting"
    with pytest.raises(ClientError, match="no engine group is ready .*0: starting, 1: failed"):
        pick([a, b, c], other, affinity=True)


def test_a_rebuilding_replica_hands_its_waiting_chat_requests_to_ready_ones():
    from apbv.serve.ranks.ops import DescribeStream

    async def scenario() -> None:
        a, b, c = replicas = _replicas(3)
        for r in replicas:
            r.peers = replicas
        calls = [SimpleNamespace(deadline_ms=None, name=n, request=None)
                 for n in ("first", "second", "third")]
        op = DescribeStream("s")  # a live stream's operation: its stream lived on a's ranks
        a.admission.max_queue = 4  # b and c take 2 each
        jobs = [a.admission.admit(calls[0], {}),
                a.admission.admit(None, {}, op=op, stream_id="s"),
                a.admission.admit(calls[1], {}), a.admission.admit(calls[2], {})]
        b.admission.running = object()  # b runs one: c is the least loaded at first
        a.status = "degraded"
        moved = a.hand_over()
        assert [j.call for j in moved] == calls  # in their order
        assert [j.replica for j in moved] == [c, b, c]  # least loaded, the lower index on ties
        assert a.admission.waiting() == [jobs[1]]  # the stream operation stays
        assert [j.call.name for j in c.admission.waiting()] == ["first", "third"]
        assert await c.admission.next() is jobs[0]
        late = b.admission.admit(SimpleNamespace(deadline_ms=None, request=None), {})
        assert b.admission.waiting() == [jobs[2], late]  # arrival order across replicas
        c.status = b.status = "degraded"
        assert b.hand_over() == []  # no ready peer with room: they wait for the rebuild

    asyncio.run(scenario())


def test_remote_url_policy():
    off, on = MediaPolicy(), MediaPolicy(allow_domains=("media.example",))
    with pytest.raises(ClientError, match="remote media is off: https URL of host 'x.org'"):
        remote_url("https://x.org/v.mp4", off)
    with pytest.raises(ClientError, match="host 'media.example.evil' is not in "
                                          "--allow-media-domain"):
        remote_url("http://media.example.evil/v.mp4", on)
    assert remote_url("https://MEDIA.example:8443/v.mp4", on) == \
        "https://MEDIA.example:8443/v.mp4"
    assert remote_url("file:///v.mp4", on) is None
    with pytest.raises(ClientError, match="bad http URL"):
        remote_url("http://media.example:99999/v.mp4", on)
