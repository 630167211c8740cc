"""Keep the garbage collector's full passes off the request path of long-running services.

Every service imports large libraries (torch, transformers, FastAPI, pydantic, OpenTelemetry) and builds its
long-lived objects at startup. CPython's oldest-generation collections walk all of them, which takes tens of
milliseconds and stalls whatever request is in flight. Freezing the heap once startup is done moves those
objects out of the collector's sight (``gc.freeze``); what requests allocate is still collected as usual.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_startup_heap(service: str) -> None:
    """Collect once, then exempt every object alive now from future collections."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info(
        "heap.frozen service=%s objects=%d elapsed_ms=%.1f",
        service,
        gc.get_freeze_count(),
        1000 * (time.perf_counter() - started),
    )
