"""What a replica records in the server's metrics, as a Protocol: the metrics
(:class:`apbv.serve.front.metrics.Metrics`) live in the room above, which imports this one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram

    from apbv.serve.scheduler.admission import Job


class ReplicaMetrics(Protocol):
    """The per-replica gauges (set from the replica's state at a scrape), the queue wait, the
    rebuilds, and each finished job."""

    queue_depth: Gauge
    running: Gauge
    replica_ready: Gauge
    replica_stalled: Gauge
    ttft_scale: Gauge
    decode_s: Gauge
    queue_wait: Histogram
    rebuilds: Counter

    def finished(self, job: Job, outcome: str, result: object = None) -> None:
        """``job`` ended with ``outcome`` (and ``result``, None without one)."""
