"""The configuration reference (docs/configuration.md): one table per concern, generated from the classes so it
cannot drift, each saying which services read it. ``tests/unit/test_settings.py`` checks the page against it."""

from __future__ import annotations

import inspect

from .admission import AdmissionSettings
from .backbone import BackboneSettings
from .base import SettingsBase
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
from .result_service import ResultServiceSettings
from .router import RouterSettings
from .routing import RoutingSettings
from .state_dir import StateDirSettings
from .telemetry import TelemetrySettings
from .usage import TenantQuotaSettings, UsageRollupSettings
from .worker import WorkerSettings

#: Every class that declares fields, in the reference's order, with its heading. Each field is declared by one.
CONCERNS: tuple[tuple[str, type[SettingsBase]], ...] = (
    ("Kafka", KafkaSettings),
    ("Kafka security", KafkaSecuritySettings),
    ("Redis", RedisSettings),
    ("Backbone namespace", BackboneSettings),
    ("State folder", StateDirSettings),
    ("Telemetry", TelemetrySettings),
    ("Fleet", FleetSettings),
    ("Public API", PublicApiSettings),
    ("Routing", RoutingSettings),
    ("Tenant quotas", TenantQuotaSettings),
    ("Usage rollup", UsageRollupSettings),
    ("Files and Batches API", BatchApiSettings),
    ("Ingress admission and per-key limits", AdmissionSettings),
    ("Ingress", IngressSettings),
    ("Engine", EngineSettings),
    ("KV offload tiers", KVOffloadSettings),
    ("GPU worker", WorkerSettings),
    ("Router", RouterSettings),
    ("Batch workers", BatchServiceSettings),
    ("Local stack", LocalStackSettings),
    ("Client tools", ClientSettings),
)

#: Each service process and the one class it reads.
SERVICES: tuple[tuple[str, type[SettingsBase]], ...] = (
    ("ingress", IngressSettings),
    ("GPU worker", WorkerSettings),
    ("router", RouterSettings),
    ("result service", ResultServiceSettings),
    ("batch worker", BatchServiceSettings),
)


def own_fields(cls: type[SettingsBase]) -> list[str]:
    """The fields ``cls`` declares itself (not those it inherits), in the order it declares them."""
    inherited = {name for base in cls.__mro__[1:] if issubclass(base, SettingsBase) for name in base.model_fields}
    return [name for name in vars(cls).get("__annotations__", {}) if name in cls.model_fields and name not in inherited]


def readers(cls: type[SettingsBase]) -> list[str]:
    """The services whose class includes ``cls``."""
    return [service for service, composed in SERVICES if issubclass(composed, cls)]


def _summary(cls: type[SettingsBase]) -> str:
    """The first paragraph of a class's docstring, on one line."""
    return " ".join(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].split())


def _services_table() -> str:
    """Which class each service reads, and the concerns it is made of (a service's own fields are its class's)."""
    rows = ["| service | settings class | concerns |", "| --- | --- | --- |"]
    for service, composed in SERVICES:
        concerns = ", ".join(title for title, cls in CONCERNS if issubclass(composed, cls) and own_fields(cls))
        rows.append(f"| {service} | `{composed.__name__}` | {concerns} |")
    return "\n".join(rows)


def _concern_table(title: str, cls: type[SettingsBase]) -> str:
    read_by = ", ".join(readers(cls)) or "the command line only"
    rows = [
        f"### {title}",
        "",
        f"`{cls.__name__}` ({cls.__module__}): {_summary(cls)} Read by: {read_by}.",
        "",
        "| variable | default | meaning |",
        "| --- | --- | --- |",
    ]
    for name in own_fields(cls):
        field = cls.model_fields[name]
        default = field.default
        shown = "(empty)" if default in ("", None) else f"`{default}`"
        rows.append(f"| `SLUICEGATE_{name.upper()}` | {shown} | {field.description or ''} |")
    return "\n".join(rows)


def settings_table_markdown() -> str:
    """The reference's generated part: the services' classes, then one table per concern, built from the classes
    above so it cannot drift."""
    return "\n\n".join([_services_table(), *(_concern_table(title, cls) for title, cls in CONCERNS)])
