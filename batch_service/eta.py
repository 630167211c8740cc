"""Each batch's honest ETA: the lines it has left plus the lines of older active batches (served first on the
batch tier, so ahead of it), divided by the rate batch lines have been finishing at (measured by the collector).
No rate yet (nothing finished) means no estimate rather than a made-up one."""

from __future__ import annotations

import logging
import time

from .metrics import ETA_CHECK_AT
from .runtime import BatchRuntime

log = logging.getLogger(__name__)

#: Seconds between ETA log lines per batch.
_LOG_EVERY_S = 10.0


async def update_etas(runtime: BatchRuntime, active: list[str]) -> dict[str, float | None]:
    """Compute and store ``eta_seconds`` for every active batch (oldest first); returns them."""
    raw = await runtime.redis.hget(runtime.names.batch_rate_key, "rate")
    rate = float(raw) if raw is not None else 0.0
    ahead = in_flight = 0
    etas: dict[str, float | None] = {}
    now = time.time()
    for batch_id in active:
        state = await runtime.batches.state(batch_id)
        if state is None or state["status"] not in ("validating", "in_progress", "cancelling", "finalizing"):
            continue
        resolved = int(state.get("completed", 0)) + int(state.get("failed", 0))
        left = max(0, int(state.get("total", 0)) - resolved)
        eta = round((ahead + left) / rate, 1) if rate > 0 and state["status"] == "in_progress" else None
        etas[batch_id] = eta
        fields: dict[str, float | str] = {"eta_seconds": eta} if eta is not None else {}
        enqueued = int(state.get("enqueued_lines", 0))
        in_flight += max(0, enqueued - (resolved - int(state.get("invalid", 0))))
        total = int(state.get("total", 0))
        if eta is not None and "eta_check_at" not in state and total and resolved >= ETA_CHECK_AT * total:
            # Kept to score this estimate against the real finish when the batch completes (lifecycle).
            fields |= {"eta_check_at": now, "eta_check_finish": now + eta}
        if now - float(state.get("eta_logged_at", 0)) >= _LOG_EVERY_S:
            fields["eta_logged_at"] = now
            log.info(
                "batch.eta batch_id=%s status=%s left=%d ahead=%d rate_lines_per_s=%.2f eta_s=%s",
                batch_id,
                state["status"],
                left,
                ahead,
                rate,
                eta,
            )
        if fields:
            await runtime.batches.set_fields(batch_id, **fields)
        ahead += left
    runtime.metrics.lines_in_flight.set(in_flight)
    runtime.metrics.active_batches.set(len(active))
    return etas
