"""The chat page (static HTML + JavaScript), the defaults it loads from ``/config.json``, and ``/healthz`` (also
``/health`` and ``/readyz``).

The page talks to ingress directly (another port, so ingress must allow CORS from this origin); the
service only tells it where ingress is and which models ingress lists. API keys never leave the
browser's localStorage: ``/config.json`` does not hand one out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from redis.exceptions import RedisError

from .context import relay_context

STATIC_DIR = Path(__file__).parent / "static"

router = APIRouter()


@router.get("/", include_in_schema=False)
@router.head("/", include_in_schema=False)  # uptime checks send HEAD (it was a 405)
async def index() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


def _ingress_url(request: Request, port: int) -> str:
    # The browser reaches ingress on the host it reached us on; only the port differs.
    scheme = "https" if request.url.scheme in ("https", "wss") else "http"
    host = request.url.hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def _first_api_key(api_keys: str, api_keys_file: Path | None) -> str | None:
    """A key this service may use to ask ingress for its models (never handed to the page)."""
    for key in api_keys.split(","):
        if key.strip():
            return key.strip()
    if api_keys_file is None or not api_keys_file.is_file():
        return None
    # Keys-file lines: a bare key, a JSON object with "key" (or only "key_hash": unusable here), or a comment.
    for line in api_keys_file.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not line.startswith("{"):
            return line
        try:
            key = json.loads(line).get("key")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(key, str) and key:
            return key
    return None


async def _ingress_models(port: int, api_key: str | None) -> tuple[list[str], str | None]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=1.5) as client:
            response = await client.get(f"http://127.0.0.1:{port}/v1/models", headers=headers)
            response.raise_for_status()
            data = response.json().get("data", [])
        return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m], None
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        return [], f"could not list models from ingress: {exc}"


@router.get("/config.json", include_in_schema=False)
async def page_config(request: Request) -> dict[str, Any]:
    """Defaults for the chat page; the page's own settings (localStorage) take precedence."""
    settings = relay_context(request).settings
    models, error = await _ingress_models(
        settings.ingress_port, _first_api_key(settings.api_keys, settings.api_keys_file)
    )
    config: dict[str, Any] = {"ingress_url": _ingress_url(request, settings.ingress_port), "models": models}
    if error:
        config["models_error"] = error
    return config


@router.head("/healthz", include_in_schema=False)
@router.head("/health", include_in_schema=False)
@router.head("/readyz", include_in_schema=False)
async def healthz_head(request: Request) -> Response:
    return Response(status_code=(await healthz(request)).status_code)


@router.get("/healthz")
@router.get("/health")
@router.get("/readyz")
async def healthz(request: Request) -> JSONResponse:
    """200 when Redis answers, the relay's one dependency (so it is the readiness check too; ``/health`` and
    ``/readyz`` answer the same, as ingress's paths are named); the relay's current load either way."""
    ctx = relay_context(request)
    body: dict[str, Any] = {"streams": ctx.hub.stream_count, "subscribers": ctx.hub.subscriber_count}
    try:
        async with ctx.hub.bounded() as redis:
            await redis.ping()
    except (RedisError, OSError) as exc:
        return JSONResponse({"status": "unavailable", "error": repr(exc), **body}, status_code=503)
    return JSONResponse({"status": "ok", **body})
