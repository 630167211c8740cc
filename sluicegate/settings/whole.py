"""The whole configuration: every concern at once, for the command line that wires all services together
(``sluicegate up``, the local stack, the admin tools) and for tests and benchmarks that build a whole pipeline.

:class:`Settings` inherits every service's class, so it can be passed wherever one service's settings are asked
for. A service started on its own reads only its own class (``IngressSettings()`` and so on), so a variable meant
for another service, even an invalid one, never stops it.
"""

from __future__ import annotations

from functools import lru_cache

from .batch_service import BatchServiceSettings
from .command_line import ClientSettings, LocalStackSettings
from .ingress import IngressSettings
from .result_service import ResultServiceSettings
from .router import RouterSettings
from .worker import WorkerSettings


class Settings(
    IngressSettings,
    WorkerSettings,
    RouterSettings,
    ResultServiceSettings,
    BatchServiceSettings,
    LocalStackSettings,
    ClientSettings,
):
    """All knobs, with defaults that work for the local stack started by ``sluicegate dev up``."""


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide whole settings, read once from the environment (the command line's; a service reads its
    own class instead)."""
    return Settings()
