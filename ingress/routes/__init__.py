"""The ingress endpoints, one ``APIRouter`` per resource: :mod:`.openai` (OpenAI-compatible completions and
models), :mod:`.native` (submit, status and cancel of ``/v1/requests``), :mod:`.ops` (health, readiness,
metrics) and :mod:`.usage` (``GET /v1/usage``: the tenant's token usage). :func:`ingress.app.create_app` puts
their routes on the app."""
