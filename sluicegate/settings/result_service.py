"""The result service: the settings of the process that relays a request's Redis stream to its client over
WebSocket and SSE. It has no field of its own: the backbone, telemetry and the public API's face are all it reads."""

from __future__ import annotations

from .backbone import BackboneSettings
from .public_api import PublicApiSettings
from .telemetry import TelemetrySettings


class ResultServiceSettings(BackboneSettings, TelemetrySettings, PublicApiSettings):
    """What the result service reads: no engine, worker, routing, admission or batch fields."""
