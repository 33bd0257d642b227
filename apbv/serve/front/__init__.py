"""What every route shares, below the streams' and watches' rooms: the
:class:`~apbv.serve.front.front.Front` (auth, body reading, limits, observing a result, the
answer of a job), the SSE answer of a job (:mod:`~apbv.serve.front.sse`) and the Prometheus
metrics (:mod:`~apbv.serve.front.metrics`, :mod:`~apbv.serve.front.metric_rules`)."""
