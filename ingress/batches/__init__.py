"""The Batch and Files API's machinery: file storage, batch state in Redis, and the Celery tasks that run a
batch's life (validate, enqueue on the batch tier, collect results from ``llm.results``, write the output files,
finalize, expire, cancel). The HTTP endpoints are in :mod:`ingress.routes.files` and :mod:`ingress.routes.batches`.
"""
