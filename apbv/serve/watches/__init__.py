"""Standing questions on live streams: the routes (:mod:`~apbv.serve.watches.routes`),
bodies (:mod:`~apbv.serve.watches.body`), what is held (:mod:`~apbv.serve.watches.state`),
evaluation (:mod:`~apbv.serve.watches.evaluator`), SSE and webhooks
(:mod:`~apbv.serve.watches.events`, :mod:`~apbv.serve.watches.webhook`)."""
