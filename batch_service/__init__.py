"""The batch service: the Celery worker (``sluicegate batch-worker``) that runs each batch's life: validate, enqueue
on the batch tier, collect results from ``llm.results``, write the output files, finalize, expire, cancel.

What it shares with ingress lives in the runtime library, which both import: file storage, batch state in Redis,
input-line checks and the Celery app (:mod:`sluicegate.batches`), and the request checks and OpenAI formats
(:mod:`sluicegate.api`). The HTTP endpoints are in :mod:`ingress.routes.files` and :mod:`ingress.routes.batches`.
"""
