"""Running the result service under uvicorn (``sluicegate result-service`` / ``python -m result_service``), with
its own settings (:class:`ResultServiceSettings`) read from the environment unless given."""

from __future__ import annotations

import uvicorn

from sluicegate.settings import ResultServiceSettings

from .app import create_app
from .hub import RelayConfig

#: Seconds between WebSocket pings; a client that does not answer within the same time is dropped.
WS_PING_INTERVAL_S = 20.0


def uvicorn_config(
    settings: ResultServiceSettings, *, config: RelayConfig | None = None, host: str = "0.0.0.0"
) -> uvicorn.Config:
    """The uvicorn configuration the service runs with (also used by the relay benchmark)."""
    return uvicorn.Config(
        create_app(settings, config=config, freeze_heap=True),
        host=host,
        port=settings.result_port,
        ws="websockets-sansio",
        ws_ping_interval=WS_PING_INTERVAL_S,
        ws_ping_timeout=WS_PING_INTERVAL_S,
        # Logging is configured once by the CLI (structured lines); uvicorn must not replace it.
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
    )


def serve(
    settings: ResultServiceSettings | None = None, *, config: RelayConfig | None = None, host: str = "0.0.0.0"
) -> None:
    """Serve until interrupted on ``settings.result_port``."""
    settings = settings or ResultServiceSettings()
    uvicorn.Server(uvicorn_config(settings, config=config, host=host)).run()
