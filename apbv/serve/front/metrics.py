"""The server's Prometheus metrics, in one registry per server (``GET /metrics`` writes it out).

Every name is ``PREFIX:name`` (``--metrics-prefix``, default ``apbv``; ``vllm`` makes vLLM's
dashboards and benchmark tools read them unchanged): vLLM's metrics under vLLM's names and
labels (``model_name``; the per-request ones add ``endpoint``: ``chat``, ``stream_ask`` or
``watch``), beside apbv's own per-stage, per-replica, stream and watch ones. The bucket lists
and labels are :mod:`apbv.serve.front.metric_rules`; ``docs/metrics.md`` lists every metric.

A replica job's request metrics are observed once, as the replica finishes it
(:meth:`Metrics.finished`): its times from its admission (``Job.enqueued``), its start on the
ranks and its tokens' arrivals, whichever endpoint it came from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from apbv.serve.front.metric_rules import (
    DEFAULT_PREFIX,
    ENDPOINTS,
    FINISHED_REASONS,
    ITL_BUCKETS,
    REQUEST_BUCKETS,
    TTFT_BUCKETS,
    check_prefix,
    endpoint_of,
    finished_reason,
    one_two_five,
)

if TYPE_CHECKING:
    from apbv.serve.scheduler.admission import Job
    from apbv.serve.scheduler.replicas import Replica

DEFAULT_MAX_MODEL_LEN = 131072
"""The token-count histograms' last bound when the server's ``max_model_len`` is not given."""


class Metrics:
    """The registry and its metrics (seconds for times, tokens for counts), named
    ``prefix:...`` with ``model_name`` on vLLM's; ``vision_cache``: the engine looks videos up
    in its vision cache (the ``mm_cache`` counters count those lookups); ``max_model_len``: the
    token-count histograms' last bound."""

    def __init__(self, model_name: str = "apbv", prefix: str = DEFAULT_PREFIX,
                 vision_cache: bool = False, max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> None:
        check_prefix(prefix)
        self.registry = r = CollectorRegistry()
        self.model_name, self.prefix, self.vision_cache = model_name, prefix, vision_cache
        model, per_request = ["model_name"], ["model_name", "endpoint"]

        def histogram(name: str, doc: str, labels: list[str], buckets: tuple) -> Histogram:
            return Histogram(f"{prefix}:{name}", doc, labels, buckets=buckets, registry=r)

        def counter(name: str, doc: str, labels: list[str]) -> Counter:
            return Counter(f"{prefix}:{name}", doc, labels, registry=r)

        def gauge(name: str, doc: str, labels: list[str]) -> Gauge:
            return Gauge(f"{prefix}:{name}", doc, labels, registry=r)

        # vLLM's metrics under vLLM's names
        self.request_ttft = histogram("time_to_first_token_seconds", "Admission to the first "
                                      "token (queue included)", per_request, TTFT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Admission to the last token",
                             per_request, REQUEST_BUCKETS)
        self.request_queue = histogram("request_queue_time_seconds", "Time queued before the "
                                       "ranks", per_request, REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "Start on the ranks to the "
                                 "first token", per_request, REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First token to the last",
                                per_request, REQUEST_BUCKETS)
        self.inference = histogram("request_inference_time_seconds", "Start on the ranks to "
                                   "the last token", per_request, REQUEST_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two generated "
                             "tokens", per_request, ITL_BUCKETS)
        tokens = one_two_five(max_model_len)
        self.request_prompt = histogram("request_prompt_tokens", "Prompt tokens of a request "
                                        "(video included)", per_request, tokens)
        self.request_generation = histogram("request_generation_tokens", "Tokens generated "
                                            "for a request", per_request, tokens)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of answered requests",
                                     per_request)
        self.generation_tokens = counter("generation_tokens", "Generated tokens", per_request)
        self.success = counter("request_success", "Finished requests by finished_reason",
                               [*per_request, "finished_reason"])
        self.num_running = gauge("num_requests_running", "Requests on the ranks", model)
        self.num_waiting = gauge("num_requests_waiting", "Requests queued", model)
        self.kv_usage = gauge("kv_cache_usage_perc", "Live streams' KV reserved per rank / "
                              "the stream budget (--stream-memory-gb), per replica (engine); "
                              "1 is full", ["model_name", "engine"])
        self.mm_queries = counter("mm_cache_queries", "Vision-cache lookups (one per chat "
                                  "request while the cache is on)", model)
        self.mm_hits = counter("mm_cache_hits", "Vision-cache lookups that found the video",
                               model)
        # apbv's own
        self.ttft = histogram("engine_ttft_seconds", "The engine's time to first token (on "
                              "the ranks, no queue)", [], TTFT_BUCKETS)
        self.queue_wait = histogram("queue_wait_seconds", "A chat request's time queued "
                                    "before the ranks", [], TTFT_BUCKETS)
        self.stage = histogram("stage_seconds", "Seconds per engine stage", ["stage"],
                               TTFT_BUCKETS)
        self.requests = counter("requests", "Replica jobs and refusals by outcome", ["outcome"])
        self.rebuilds = counter("group_rebuilds", "Rank-group rebuilds", [])
        self.queue_depth = gauge("replica_queue_depth", "Requests waiting per replica",
                                 ["replica"])
        self.running = gauge("replica_running", "Requests running per replica (0 or 1)",
                             ["replica"])
        self.replica_ready = gauge("replica_ready", "1 while the replica is ready", ["replica"])
        self.replica_stalled = gauge("replica_stalled", "1 while a rank of the replica does "
                                     "not answer (its job ran past its prediction)", ["replica"])
        self.ttft_scale = gauge("ttft_model_scale", "Measured / cost-model TTFT learned per "
                                "replica (deadline admission's correction)", ["replica"])
        self.decode_s = gauge("decode_token_seconds", "Seconds per generated token learned per "
                              "replica (deadline admission's decode time)", ["replica"])
        self.streams_open = gauge("streams_open", "Live streams open", model)
        self.watches = gauge("watches", "Standing questions on the open streams", model)
        self.watch_events = counter("events", "Standing questions' events",
                                    model).labels(model_name)
        self.capture_to_event = histogram("capture_to_event_seconds", "Arrival of the chunk "
                                          "to its watch event", model,
                                          TTFT_BUCKETS).labels(model_name)
        self.watch_evaluations = counter("watch_evaluations", "Evaluations of standing "
                                         "questions", model).labels(model_name)
        self.watch_coalesced = counter("watch_coalesced", "Chunks folded into a later "
                                       "evaluation", model).labels(model_name)
        self.watch_reused = counter("watch_reused", "Evaluations answered by the previous one "
                                    "(the stream gained no tokens)", model).labels(model_name)
        self.events_dropped = counter("events_dropped", "Events a full subscriber or webhook "
                                      "queue dropped", model).labels(model_name)
        self.pushes_held = counter("stream_pushes_held", "Pushes of pruned streams the server "
                                   "held (they keep no patch: no job on the ranks)",
                                   model).labels(model_name)
        self._held_counted = 0
        self._zero_series()

    def _zero_series(self) -> None:
        """Every labelled series that does not depend on a replica exists from the start, at
        0 (a dashboard's rate() reads 0, not "no data", before the first request)."""
        name = self.model_name
        metric: MetricWrapperBase
        for metric in (self.num_running, self.num_waiting, self.mm_queries, self.mm_hits,
                       self.streams_open, self.watches):
            metric.labels(name)
        for endpoint in ENDPOINTS:
            for metric in (self.request_ttft, self.e2e, self.request_queue, self.prefill,
                           self.decode, self.inference, self.itl, self.request_prompt,
                           self.request_generation, self.prompt_tokens,
                           self.generation_tokens):
                metric.labels(name, endpoint)
            for reason in FINISHED_REASONS:
                self.success.labels(name, endpoint, reason)

    def finished(self, job: Job, outcome: str, result: Any = None) -> None:
        """A replica job ended with ``outcome`` (and ``result``, None without one): counted
        by outcome, and when it is a request (:func:`~apbv.serve.front.metric_rules.endpoint_of`)
        by finished reason, its times and tokens observed under its endpoint."""
        self.requests.labels(outcome).inc()
        endpoint = endpoint_of(job)
        if endpoint is None:
            return
        labels = (self.model_name, endpoint)
        self.success.labels(*labels, finished_reason(outcome, result)).inc()
        if result is None or not hasattr(result, "ttft_s"):
            return
        now = time.monotonic()
        started = job.started if job.started is not None else now
        times = job.token_times
        first = times[0] if times else started + result.ttft_s
        self.request_queue.labels(*labels).observe(started - job.enqueued)
        self.request_ttft.labels(*labels).observe(first - job.enqueued)
        self.e2e.labels(*labels).observe(now - job.enqueued)
        self.prefill.labels(*labels).observe(first - started)
        self.decode.labels(*labels).observe(max(0.0, now - first))
        self.inference.labels(*labels).observe(now - started)
        for before, after in zip(times, times[1:], strict=False):
            self.itl.labels(*labels).observe(after - before)
        prompt, generated = result.context_len + result.query_len, len(result.token_ids)
        self.request_prompt.labels(*labels).observe(prompt)
        self.request_generation.labels(*labels).observe(generated)
        self.prompt_tokens.labels(*labels).inc(prompt)
        self.generation_tokens.labels(*labels).inc(generated)
        if endpoint == "chat" and self.vision_cache:
            self.mm_queries.labels(self.model_name).inc()
            if getattr(result, "vision_cache_hit", False):
                self.mm_hits.labels(self.model_name).inc()

    def count_load(self, replicas: list[Replica], streams: StreamLoad | None = None) -> None:
        """Set the gauges read at a scrape: requests running and waiting, and with live
        ``streams`` (None: not served) the streams and watches open and each replica's KV
        reserved against the stream budget."""
        name = self.model_name
        self.num_running.labels(name).set(
            sum(r.admission.running is not None for r in replicas))
        self.num_waiting.labels(name).set(sum(len(r.admission) for r in replicas))
        budget = 0 if streams is None else streams.budget_bytes
        for i, replica in enumerate(replicas):
            held = 0 if streams is None else streams.held[i]
            self.kv_usage.labels(name, str(replica.index)).set(held / budget if budget else 0.0)
        if streams is not None:
            self.streams_open.labels(name).set(streams.open)
            self.watches.labels(name).set(streams.watches)
            self.pushes_held.inc(max(0, streams.pushes_held - self._held_counted))
            self._held_counted = max(self._held_counted, streams.pushes_held)


@dataclass(frozen=True)
class StreamLoad:
    """The live streams at a scrape, as the metrics count them."""

    open: int
    """Streams open."""
    watches: int
    """Watches on them."""
    budget_bytes: int
    """The stream budget of each replica (bytes of KV)."""
    held: tuple[int, ...]
    """Bytes of KV each replica's streams reserve, in the order of the replicas."""
    pushes_held: int = 0
    """Pushes the server held since it started (:mod:`apbv.serve.streams.hold`)."""
