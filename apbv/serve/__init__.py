"""The HTTP server: an OpenAI-style front end over H engine ranks held as Ray actors.

:mod:`apbv.serve.policy` (media policy, limits; pure), :mod:`apbv.serve.bodies` (strict JSON
bodies), :mod:`apbv.serve.http_guard` (Host check, read deadlines, answers at shutdown),
:mod:`apbv.serve.chat_body` and :mod:`apbv.serve.api` (chat requests in),
:mod:`apbv.serve.responses` and :mod:`apbv.serve.sse` (answers and stream chunks out),
:mod:`apbv.serve.admission` (the queue and deadline admission), :mod:`apbv.serve.ops` (the one
typed operation that crosses Ray), :mod:`apbv.serve.group` (the rank actors),
:mod:`apbv.serve.replicas` (each group's queue and worker), :mod:`apbv.serve.streams` and
:mod:`apbv.serve.stream_registry` (live streams: routes; open streams and their budget),
:mod:`apbv.serve.watches`, :mod:`apbv.serve.watch_body`, :mod:`apbv.serve.watch_state`,
:mod:`apbv.serve.watch_eval`, :mod:`apbv.serve.watch_rules` and :mod:`apbv.serve.events`
(standing questions on streams: routes and budget; bodies; what is held; evaluation; the event
rule; SSE and webhooks),
:mod:`apbv.serve.metrics` (Prometheus metrics), :mod:`apbv.serve.app` (routes),
:mod:`apbv.serve.main` (``python -m apbv serve``).
The server imports the engine; the engine never imports the server.
"""
