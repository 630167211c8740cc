"""The objects every endpoint of the result service shares, kept on ``app.state.relay``."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import HTTPConnection

from schemas import Names
from sluicegate.cancellation import Canceller
from sluicegate.settings import ResultServiceSettings

from .hub import StreamHub
from .telemetry import RelayMetrics


@dataclass(frozen=True)
class RelayContext:
    settings: ResultServiceSettings
    names: Names
    hub: StreamHub
    canceller: Canceller
    metrics: RelayMetrics


def relay_context(connection: HTTPConnection) -> RelayContext:
    """The context of the app serving ``connection`` (a Request or a WebSocket)."""
    context: RelayContext = connection.app.state.relay
    return context
