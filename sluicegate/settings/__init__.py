"""Process settings of every Sluicegate service, read from the environment (``SLUICEGATE_<FIELD>``), split by
concern: one class per concern (Kafka, Redis, telemetry, routing, the engine, ...), and one class per service
composed of the concerns it reads plus its own fields, so each service reads and validates only its own variables.
:class:`Settings` is all of them at once, for the command line that wires everything and for tests.

Every field is declared once, by one class; a class that needs another concern's fields in its own helpers
(routing builds on the backbone's topics) inherits that concern. A service's class lists a concern before any it
builds on, as Python's method order requires. Nested values use JSON (e.g. ``SLUICEGATE_TENANT_WEIGHTS``).
docs/configuration.md lists every field by concern (:func:`settings_table_markdown`).
"""

from .admission import AdmissionSettings
from .backbone import BackboneSettings
from .base import SettingsBase, comma_separated
from .batch_api import BatchApiSettings
from .batch_service import BatchServiceSettings
from .command_line import ClientSettings, LocalStackSettings
from .engine import EngineSettings
from .fleet import FleetSettings
from .ingress import IngressSettings
from .kafka import KafkaSettings
from .kafka_security import KafkaSecuritySettings
from .kv_offload import KVOffloadSettings
from .public_api import PublicApiSettings
from .redis import RedisSettings
from .reference import settings_table_markdown
from .result_service import ResultServiceSettings
from .router import RouterSettings
from .routing import RoutingSettings
from .state_dir import StateDirSettings
from .telemetry import TelemetrySettings
from .usage import TenantQuotaSettings, UsageRollupSettings
from .whole import Settings, get_settings
from .worker import WorkerSettings

__all__ = [
    "AdmissionSettings",
    "BackboneSettings",
    "BatchApiSettings",
    "BatchServiceSettings",
    "ClientSettings",
    "EngineSettings",
    "FleetSettings",
    "IngressSettings",
    "KVOffloadSettings",
    "KafkaSecuritySettings",
    "KafkaSettings",
    "LocalStackSettings",
    "PublicApiSettings",
    "RedisSettings",
    "ResultServiceSettings",
    "RouterSettings",
    "RoutingSettings",
    "Settings",
    "SettingsBase",
    "StateDirSettings",
    "TelemetrySettings",
    "TenantQuotaSettings",
    "UsageRollupSettings",
    "WorkerSettings",
    "comma_separated",
    "get_settings",
    "settings_table_markdown",
]
