"""The OpenAI chat protocol, with no FastAPI and no Ray: the chat body and its readers
(:mod:`~apbv.openai.chat_body`, :mod:`~apbv.openai.chat_fields`, :mod:`~apbv.openai.image_parts`,
:mod:`~apbv.openai.structured`), a request to an engine ``Request`` (:mod:`~apbv.openai.chat`), a
``Result`` to a response body (:mod:`~apbv.openai.responses`, :mod:`~apbv.openai.detok`), strict
JSON bodies (:mod:`~apbv.openai.bodies`), media policy, limits and ``ClientError``
(:mod:`~apbv.openai.policy`), downloads (:mod:`~apbv.openai.download`), pushed and image frames
(:mod:`~apbv.openai.frames`) and the ``X-Request-Id`` rule (:mod:`~apbv.openai.request_id`).
Spoken by ``apbv serve`` and ``apbv batch`` alike."""
