"""The HTTP server: an OpenAI-style front end over H engine ranks held as Ray actors.

It speaks the protocol of :mod:`apbv.openai` and judges watches with :mod:`apbv.watch`. Its
rooms, each importing only those below it (``tests/unit/test_import_rules.py``):
:mod:`apbv.serve.ranks` (the typed operations that cross Ray, the rank actors, placement, the
Ray cluster) <- :mod:`apbv.serve.scheduler` (admission, the memory budget, the fair order, each
replica's queue and worker) <- :mod:`apbv.serve.front` (what every route shares: the
:class:`~apbv.serve.front.front.Front`, SSE answers, the metrics) <- :mod:`apbv.serve.streams`
(live streams: routes, the registry, budget and price) <- :mod:`apbv.serve.watches` (standing
questions on streams) <- the app at the root: :mod:`apbv.serve.main` (``python -m apbv
serve``), :mod:`apbv.serve.app` (builds the front, the streams and the watches side by side;
the chat routes), :mod:`apbv.serve.http_guard` (Host check, read deadlines, answers at
shutdown), :mod:`apbv.serve.page` and the log (:mod:`apbv.serve.log_format`,
:mod:`apbv.serve.access_log`).
The server imports the engine; the engine never imports the server.
"""
