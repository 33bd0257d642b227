"""The request path on every rank: the request, the engine, prefill, decode, the KV cache and
the routing of video embeddings. Clients (the CLI, the demo, benchmarks, evaluation, the
server) call :class:`apbv.engine.engine.Engine`; nothing here imports a client.

Import the submodules directly (``from apbv.engine.engine import Engine``): this package's
``__init__`` stays empty so that the pure pieces (routing, kvcache) load without the model.
"""
