"""OpenAI's Responses API on the pipeline: request bodies (:mod:`.bodies`, :mod:`.items`), the response object and
its streamed events derived from a request's Redis stream (:mod:`.objects`, :mod:`.events`), stored responses and
conversations in Redis (:mod:`.store`), and following or replaying a response's stream (:mod:`.relay`). The routes
are in :mod:`ingress.routes.responses`."""
