"""Live streams: the routes (:mod:`~apbv.serve.streams.routes`), the open streams
(:mod:`~apbv.serve.streams.registry`), their KV budget (:mod:`~apbv.serve.streams.budget`) and
time price (:mod:`~apbv.serve.streams.pricing`), how a stream ends
(:mod:`~apbv.serve.streams.end`) and the options (:mod:`~apbv.serve.streams.options`)."""
