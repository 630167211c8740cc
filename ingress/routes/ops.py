"""Operations endpoints, open without a key: ``/healthz`` (the process is up; also ``/health``, where vLLM, SGLang
and TGI answer it and load generators such as guidellm look), ``/readyz`` (Redis and Kafka answer) and
``/metrics`` (Prometheus)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from ..app_state import metrics_of, service_of
from ..openapi import Health, Readiness, ok, plain_text

router = APIRouter(tags=["ops"])


@router.get("/health", responses=ok(Health))
@router.get("/healthz", responses=ok(Health))
async def healthz(request: Request) -> dict[str, Any]:
    service = service_of(request)
    return {"status": "ok", "kafka_producer": "started" if service.producers.started else "not_started"}


@router.get("/readyz", responses=ok(Readiness) | ok(Readiness, status=503))
async def readyz(request: Request) -> JSONResponse:
    service = service_of(request)
    problems: dict[str, str] = {}
    try:
        await service.redis.ping()
    except (RedisError, OSError) as exc:
        problems["redis"] = f"Redis is unavailable: {str(exc) or type(exc).__name__}"
    try:
        await service.producers.start()
    except Exception as exc:
        problems["kafka"] = f"Kafka is unavailable: {str(exc) or type(exc).__name__}"
    return JSONResponse(
        {"status": "ok" if not problems else "unavailable", **problems}, status_code=503 if problems else 200
    )


# HEAD, which uptime checks and load balancers send (RFC 9110: a server that answers GET answers HEAD), was a 405.
@router.head("/health", include_in_schema=False)
@router.head("/healthz", include_in_schema=False)
async def healthz_head() -> Response:
    return Response(status_code=200)


@router.head("/readyz", include_in_schema=False)
async def readyz_head(request: Request) -> Response:
    return Response(status_code=(await readyz(request)).status_code)


@router.get(
    "/metrics",
    response_class=Response,
    responses=plain_text("Prometheus metrics in the text exposition format."),
)
async def prometheus_metrics(request: Request) -> Response:
    return Response(generate_latest(metrics_of(request).registry), media_type=CONTENT_TYPE_LATEST)
