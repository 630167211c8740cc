"""``GET /v1/usage``: the caller's tenant's token usage over a window, from the rollup of the usage ledger
(:mod:`sluicegate.usage.report`), in total and grouped by model or by API key.

A key sees its own tenant's usage only (every key of the tenant, and Kafka-native requests of the tenant under
``key_id`` null). ``start`` and ``end`` are unix seconds (default: the current UTC month so far; with only ``end``,
the UTC month it falls in up to it), widened to whole hours; the rollup lags the ledger by about a second.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request

from sluicegate.api.errors import ApiError
from sluicegate.usage.report import MAX_WINDOW_S, GroupBy, UsageReport, usage_report

from ..app_state import service_of
from ..auth import Caller
from ..openapi import errors

router = APIRouter(tags=["usage"])

#: The largest unix time accepted (year 9999), so a window is always a real date.
_MAX_TIME = 253_402_300_799


def month_start(now: float) -> int:
    """The first second of the UTC month ``now`` falls in."""
    moment = datetime.fromtimestamp(now, UTC)
    return int(moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0).timestamp())


@router.get("/v1/usage", response_model=UsageReport, responses=errors(400, 401, 503))
async def get_usage(
    request: Request,
    caller: Caller,
    start: Annotated[
        int | None,
        Query(
            ge=0,
            le=_MAX_TIME,
            description=f"Unix seconds; default: the start of end's UTC month. At most {MAX_WINDOW_S // 86400} "
            "days before end (else a 400 invalid_value naming start).",
        ),
    ] = None,
    end: Annotated[
        int | None,
        Query(
            ge=1,
            le=_MAX_TIME,
            description="Unix seconds; default: now. After start (else a 400 invalid_value naming end).",
        ),
    ] = None,
    group_by: Annotated[GroupBy | None, Query(description="Rows per model, per API key or per LoRA adapter.")] = None,
) -> UsageReport:
    now = time.time()
    end = end if end is not None else int(now) + 1
    # Without a start, the window is the month the end falls in (the current month's start would come after an
    # earlier end, and the window would be refused).
    start = start if start is not None else month_start(min(now, end - 1))
    service = service_of(request)
    try:
        return await usage_report(service.redis, service.names, caller.tenant, start=start, end=end, group_by=group_by)
    except ValueError as exc:
        # An end at or before the start is the end's fault; a window too long, the start's.
        param = "end" if end <= start else "start"
        raise ApiError(400, str(exc), code="invalid_value", param=param) from exc
