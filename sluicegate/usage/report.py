"""Reading the rollup's aggregates: one tenant's usage over a time window, in total and grouped by model, by API
key or by LoRA adapter (``GET /v1/usage``, ``sluicegate usage``).

The rollup keeps whole hours (by when each request finished), so a window is widened to whole hours: ``start``
down, ``end`` up; the report says which window it covers.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, Field
from redis.asyncio import Redis

from schemas import Names

from .rollup import METRICS

GroupBy = Literal["model", "key", "adapter"]

#: The longest window one report may cover.
MAX_WINDOW_S = 400 * 86400


class UsageRow(BaseModel):
    """Usage of one group (a model, an API key) or of the whole tenant."""

    model: str | None = Field(None, description="The model version (with group_by=model).")
    key_id: str | None = Field(None, description="The API key's id (with group_by=key); null: no key (Kafka-native).")
    adapter: str | None = Field(None, description="The LoRA adapter (with group_by=adapter); null: the base model.")
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = Field(0, description="Prompt tokens the engine's prefix cache served.")
    output_tokens: int = 0
    total_tokens: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    response_cache: int = Field(0, description="Requests answered from the response cache.")


class UsageReport(BaseModel):
    """A tenant's usage between ``start`` and ``end`` (unix seconds, whole hours)."""

    object: Literal["usage"] = "usage"
    tenant: str
    start: int
    end: int
    group_by: GroupBy | None = None
    data: list[UsageRow] = Field(default_factory=list, description="One row per group, largest total first.")
    totals: UsageRow


def hour_window(start: int, end: int) -> tuple[int, int]:
    """The first and last hour (unix seconds // 3600) a window covers, widened to whole hours."""
    return start // 3600, max(start // 3600, math.ceil(end / 3600) - 1)


async def usage_report(
    redis: Redis, names: Names, tenant: str, *, start: int, end: int, group_by: GroupBy | None = None
) -> UsageReport:
    """The tenant's usage in [start, end); ``ValueError`` for an empty or too long window."""
    if end <= start:
        raise ValueError(f"end ({end}) must be after start ({start})")
    if end - start > MAX_WINDOW_S:
        raise ValueError(f"the window is longer than {MAX_WINDOW_S // 86400} days")
    first, last = hour_window(start, end)
    hours = await redis.zrangebyscore(names.usage_hours_key(tenant), first, last)
    pipe = redis.pipeline(transaction=False)
    for hour in hours:
        pipe.hgetall(names.usage_bucket_key(tenant, int(hour)))
    buckets = await pipe.execute() if hours else []
    by_model: dict[str, dict[str, int]] = {}
    by_key: dict[str, dict[str, int]] = {}
    by_adapter: dict[str, dict[str, int]] = {}
    for bucket in buckets:
        for raw_field, raw_value in bucket.items():
            field = raw_field.decode() if isinstance(raw_field, bytes) else raw_field
            group, metric, value = field.split("|", 2)
            if metric not in METRICS:
                continue
            target = {"model": by_model, "key": by_key, "adapter": by_adapter}.get(group)
            if target is not None:
                row = target.setdefault(value, {})
                row[metric] = row.get(metric, 0) + int(raw_value)
    totals = UsageRow()
    for metrics in by_model.values():  # every record has a model: the model rows add up to the tenant's
        totals = totals.model_copy(update={m: getattr(totals, m) + n for m, n in metrics.items()})
    data: list[UsageRow] = []
    if group_by == "model":
        data = [UsageRow(model=name, **metrics) for name, metrics in by_model.items()]
    elif group_by == "key":
        data = [UsageRow(key_id=key or None, **metrics) for key, metrics in by_key.items()]
    elif group_by == "adapter":
        # Hours rolled up before adapters were counted have no adapter group: their requests are missing here.
        data = [UsageRow(adapter=name or None, **metrics) for name, metrics in by_adapter.items()]
    data.sort(key=lambda row: (-row.total_tokens, row.model or row.key_id or row.adapter or ""))
    return UsageReport(
        tenant=tenant, start=first * 3600, end=(last + 1) * 3600, group_by=group_by, data=data, totals=totals
    )
