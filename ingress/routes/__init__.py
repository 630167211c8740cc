"""The ingress endpoints, one ``APIRouter`` per resource: :mod:`.openai` (OpenAI-compatible completions and
models), :mod:`.native` (submit, status and cancel of ``/v1/requests``) and :mod:`.ops` (health, readiness,
metrics). :func:`ingress.app.create_app` puts their routes on the app."""
