"""The server's Prometheus metrics: vLLM's names under an ``apbv:`` prefix with a
``model_name`` label (a vLLM dashboard reads them), beside apbv's own per-stage and per-replica
ones, in one registry per server (``GET /metrics`` writes it out)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from apbv.engine.request import Result
    from apbv.serve.admission import Job
    from apbv.serve.replicas import Replica

BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
"""Seconds between two generated tokens (vLLM's inter-token buckets, and longer ones)."""

class Metrics:
    """The registry and its metrics (seconds for times, tokens for counts)."""

    def __init__(self, model_name: str = "apbv") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        label = ["model_name"]
        # vLLM's metrics, under apbv: (a chat request's, from its admission on)
        self.request_ttft = Histogram("apbv:time_to_first_token_seconds", "Time to first "
                                      "token, queue included", label, buckets=BUCKETS,
                                      registry=r)
        self.e2e = Histogram("apbv:e2e_request_latency_seconds", "Admission to the last token",
                             label, buckets=BUCKETS, registry=r)
        self.request_queue = Histogram("apbv:request_queue_time_seconds", "Time queued before "
                                       "the ranks", label, buckets=BUCKETS, registry=r)
        self.itl = Histogram("apbv:inter_token_latency_seconds", "Time between two generated "
                             "tokens", label, buckets=TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = Counter("apbv:prompt_tokens", "Prompt tokens of answered "
                                     "requests", label, registry=r)
        self.generation_tokens = Counter("apbv:generation_tokens", "Generated tokens", label,
                                         registry=r)
        self.num_running = Gauge("apbv:num_requests_running", "Requests on the ranks", label,
                                 registry=r)
        self.num_waiting = Gauge("apbv:num_requests_waiting", "Requests queued", label,
                                 registry=r)
        # apbv's own
        self.ttft = Histogram("apbv_ttft_seconds", "Time to first token", buckets=BUCKETS,
                              registry=r)
        self.queue_wait = Histogram("apbv_queue_wait_seconds", "Time queued before the ranks",
                                    buckets=BUCKETS, registry=r)
        self.stage = Histogram("apbv_stage_seconds", "Seconds per engine stage", ["stage"],
                               buckets=BUCKETS, registry=r)
        self.requests = Counter("apbv_requests", "Requests by outcome", ["outcome"], registry=r)
        self.cache_hits = Counter("apbv_vision_cache_hits", "Vision-embedding cache hits",
                                  registry=r)
        self.rebuilds = Counter("apbv_group_rebuilds", "Rank-group rebuilds", registry=r)
        self.queue_depth = Gauge("apbv_replica_queue_depth", "Requests waiting per replica",
                                 ["replica"], registry=r)
        self.running = Gauge("apbv_replica_running", "Requests running per replica (0 or 1)",
                             ["replica"], registry=r)
        self.replica_ready = Gauge("apbv_replica_ready", "1 while the replica is ready",
                                   ["replica"], registry=r)
        self.replica_stalled = Gauge("apbv_replica_stalled", "1 while a rank of the replica "
                                     "does not answer (its job ran past its prediction)",
                                     ["replica"], registry=r)
        self.ttft_scale = Gauge("apbv_ttft_model_scale", "Measured / cost-model TTFT learned "
                                "per replica (deadline admission's correction)", ["replica"],
                                registry=r)
        self.decode_s = Gauge("apbv_decode_token_seconds", "Seconds per generated token learned "
                              "per replica (deadline admission's decode time)", ["replica"],
                              registry=r)

    def observe_request(self, job: Job, result: Result) -> None:
        """A chat request's vLLM metrics, once it is answered: its times from its admission
        (``job.enqueued``), the gaps between its tokens' arrivals, its token counts."""
        name, now = self.model_name, time.monotonic()
        started = job.started if job.started is not None else now
        times = job.token_times
        first = times[0] if times else started + result.ttft_s
        self.request_queue.labels(name).observe(started - job.enqueued)
        self.request_ttft.labels(name).observe(first - job.enqueued)
        self.e2e.labels(name).observe(now - job.enqueued)
        for before, after in zip(times, times[1:], strict=False):
            self.itl.labels(name).observe(after - before)
        self.prompt_tokens.labels(name).inc(result.context_len + result.query_len)
        self.generation_tokens.labels(name).inc(len(result.token_ids))

    def count_load(self, replicas: list[Replica]) -> None:
        """Set the running and waiting gauges from the replicas' queues."""
        self.num_running.labels(self.model_name).set(
            sum(r.admission.running is not None for r in replicas))
        self.num_waiting.labels(self.model_name).set(sum(len(r.admission) for r in replicas))
