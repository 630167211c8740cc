"""The pipeline benchmark's analysis and tables: join the client samples with the worker's stamps into
per-request series (overhead and its four stages), and print them, the CPU cost, the transport floor and the
relay throughput as markdown tables against their targets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from benchmarks import relay
from benchmarks.common import fmt, markdown_table, percentile
from benchmarks.pipeline_load import Sample, TransportFloor

STAGES = ("ingress+kafka", "pickup", "emit", "relay")
TARGET_RATE = 50.0
TARGET_P50_MS = 5.0
TARGET_P99_MS = 20.0
TARGET_RELAY_CLIENTS = 500
TARGET_RELAY_TOKENS_S = 50_000.0


@dataclass
class Level:
    """The figures of one arrival rate."""

    rate: float
    duration_s: float
    samples: list[Sample]
    #: ms per request: e2e TTFT, engine TTFT, overhead, POST, and the four stages when stamped.
    series: dict[str, list[float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    unmatched: int = 0
    #: Means over the level from ingress's own timers (ms): Kafka publish, and the whole POST handler.
    publish_mean_ms: float = math.nan
    handler_mean_ms: float = math.nan
    #: CPU milliseconds per request of each process over the level.
    cpu_ms: dict[str, float] = field(default_factory=dict)

    def p(self, name: str, q: float) -> float:
        return percentile(self.series.get(name, []), q)

    @property
    def completed(self) -> int:
        return sum(1 for s in self.samples if s.done and s.error is None)


def analyse(level: Level, stamps: dict[str, dict[str, float]]) -> None:
    """Join the client samples with the worker's stamps into per-request series (ms)."""
    names = ("e2e", "engine", "overhead", "post", "late", "ingress", "kafka", "handback", *STAGES)
    series: dict[str, list[float]] = {name: [] for name in names}
    for sample in level.samples:
        if sample.error is not None or not sample.first:
            level.errors.append(sample.error or "no token received")
            continue
        worker = stamps.get(sample.request_id, {})
        if "arrival" not in worker or "first_token" not in worker:
            level.unmatched += 1
            continue
        e2e = sample.first - sample.sent
        engine = worker["first_token"] - worker["arrival"]
        series["e2e"].append(1000 * e2e)
        series["engine"].append(1000 * engine)
        series["overhead"].append(1000 * (e2e - engine))
        series["post"].append(1000 * (sample.accepted - sample.sent))
        series["late"].append(1000 * sample.lateness)
        if "admitted" in worker and "flushed" in worker:
            series["ingress+kafka"].append(1000 * (worker["admitted"] - sample.sent))
            series["pickup"].append(1000 * (worker["arrival"] - worker["admitted"]))
            series["emit"].append(1000 * (worker["flushed"] - worker["first_token"]))
            series["relay"].append(1000 * (sample.first - worker["flushed"]))
        if "delivered" in worker:
            series["handback"].append(1000 * (worker["delivered"] - worker["first_token"]))
        if "admitted" in worker and "produced" in worker:
            series["ingress"].append(1000 * (worker["produced"] - sample.sent))
            series["kafka"].append(1000 * (worker["admitted"] - worker["produced"]))
    level.series = series


def latency_table(levels: Sequence[Level]) -> str:
    header = [
        "offered req/s",
        "requests",
        "completed",
        "e2e TTFT p50 / p99 ms",
        "engine TTFT p50 / p99 ms",
        "overhead p50 ms",
        "overhead p99 ms",
        "POST p50 / p99 ms",
        "target (p50 <= 5, p99 <= 20 at 50/s)",
    ]
    rows = []
    for lv in levels:
        target = ""
        if lv.rate == TARGET_RATE:
            met = lv.p("overhead", 0.5) <= TARGET_P50_MS and lv.p("overhead", 0.99) <= TARGET_P99_MS
            target = "met" if met else "missed"
        rows.append(
            [
                f"{lv.rate:g}",
                str(len(lv.samples)),
                str(lv.completed),
                f"{fmt(lv.p('e2e', 0.5))} / {fmt(lv.p('e2e', 0.99))}",
                f"{fmt(lv.p('engine', 0.5))} / {fmt(lv.p('engine', 0.99))}",
                fmt(lv.p("overhead", 0.5)),
                fmt(lv.p("overhead", 0.99)),
                f"{fmt(lv.p('post', 0.5))} / {fmt(lv.p('post', 0.99))}",
                target,
            ]
        )
    return markdown_table(header, rows)


def stage_table(levels: Sequence[Level]) -> str:
    header = [
        "offered req/s",
        *(f"{s} p50 / p99 ms" for s in STAGES),
        "of which ingress / Kafka p50 ms (record CreateTime, 1 ms resolution)",
        "of which engine -> worker loop p50 / p99 ms",
        "ingress handler / Kafka publish mean ms",
        "arrival lateness p99 ms",
    ]
    rows = []
    for lv in levels:
        cells = [f"{lv.rate:g}", *(f"{fmt(lv.p(s, 0.5))} / {fmt(lv.p(s, 0.99))}" for s in STAGES)]
        cells.append(f"{fmt(lv.p('ingress', 0.5))} / {fmt(lv.p('kafka', 0.5))}")
        cells.append(f"{fmt(lv.p('handback', 0.5))} / {fmt(lv.p('handback', 0.99))}")
        cells.append(f"{fmt(lv.handler_mean_ms)} / {fmt(lv.publish_mean_ms)}")
        cells.append(fmt(lv.p("late", 0.99)))
        rows.append(cells)
    return markdown_table(header, rows)


def cpu_table(levels: Sequence[Level]) -> str:
    names = sorted({name for lv in levels for name in lv.cpu_ms})
    rows = []
    for lv in levels:
        total = sum(lv.cpu_ms.values())
        busy = total * len(lv.samples) / 1000 / lv.duration_s
        cells = [fmt(lv.cpu_ms.get(name, math.nan)) for name in names]
        rows.append([f"{lv.rate:g}", *cells, f"{total:.1f}", f"{busy:.2f}"])
    return markdown_table(["offered req/s", *names, "total", "cores busy"], rows)


@dataclass
class RelayRow:
    outcome: relay.Outcome

    @property
    def tokens_per_s(self) -> float:
        sc = self.outcome.scenario
        # Each stream carries ``tokens`` token events and one ``done``; only the tokens count here.
        return self.outcome.rate * sc.tokens / (sc.tokens + 1)


def relay_table(rows: Sequence[RelayRow]) -> str:
    header = [
        "clients",
        "streams",
        "events delivered",
        "seconds",
        "tokens/s to clients",
        "latency p50 / p99 ms",
        "result service CPU %",
        "target (>= 50,000 tokens/s at 500)",
    ]
    cells = []
    for row in rows:
        o, sc = row.outcome, row.outcome.scenario
        target = ""
        if sc.clients == TARGET_RELAY_CLIENTS:
            target = "met" if row.tokens_per_s >= TARGET_RELAY_TOKENS_S and not o.errors else "missed"
        cells.append(
            [
                str(sc.clients),
                str(sc.streams),
                f"{o.delivered:,}",
                f"{o.seconds:.2f}",
                f"{row.tokens_per_s:,.0f}",
                f"{o.percentile(0.5):.1f} / {o.percentile(0.99):.1f}",
                f"{100 * o.server_cpu_s / o.seconds:.0f}",
                f"{target}{' (errors)' if o.errors else ''}",
            ]
        )
    return markdown_table(header, cells)


def floor_table(floor: TransportFloor, levels: Sequence[Level]) -> str:
    (k50, r50, t50), (k99, r99, t99) = floor.p(0.5), floor.p(0.99)
    rows = [
        ["Kafka: produce (acks=all) -> consumer holds it", str(len(floor.kafka_ms)), fmt(k50), fmt(k99)],
        ["Redis: XADD -> blocked XREAD has it", str(len(floor.redis_ms)), fmt(r50), fmt(r99)],
        ["sum: the transport floor of one request", "", fmt(t50), fmt(t99)],
    ]
    runs: dict[float, int] = {}
    for level in levels:
        overhead = level.series.get("overhead", [])
        o50, o99 = percentile(overhead, 0.5), percentile(overhead, 0.99)
        runs[level.rate] = runs.get(level.rate, 0) + 1
        which = f" (run {runs[level.rate]} at this rate)" if runs[level.rate] > 1 else ""
        label = f"pipeline overhead at {level.rate:g} req/s{which}, as a multiple of the floor"
        rows.append([label, "", f"{fmt(o50 / t50)}x", f"{fmt(o99 / t99)}x"])
    return markdown_table(["transport alone", "samples", "p50 ms", "p99 ms"], rows)


def tracing_split_table(split: Sequence[tuple[Level, Level]]) -> str:
    """``--tracing mixed``: overhead and TTFT of the traced and the untraced requests of the same run."""
    rows = []
    for traced, untraced in split:
        for name, level in (("traced", traced), ("untraced", untraced)):
            rows.append(
                [
                    f"{level.rate:g}",
                    name,
                    str(len(level.series.get("overhead", []))),
                    f"{fmt(level.p('e2e', 0.5))} / {fmt(level.p('e2e', 0.99))}",
                    f"{fmt(level.p('engine', 0.5))} / {fmt(level.p('engine', 0.99))}",
                    fmt(level.p("overhead", 0.5)),
                    fmt(level.p("overhead", 0.99)),
                ]
            )
        rows.append(
            [
                f"{traced.rate:g}",
                "traced - untraced",
                "",
                "",
                "",
                f"{traced.p('overhead', 0.5) - untraced.p('overhead', 0.5):+.2f}",
                f"{traced.p('overhead', 0.99) - untraced.p('overhead', 0.99):+.2f}",
            ]
        )
    header = [
        "offered req/s",
        "half",
        "n",
        "e2e TTFT p50 / p99 ms",
        "engine TTFT p50 / p99 ms",
        "overhead p50 ms",
        "overhead p99 ms",
    ]
    return markdown_table(header, rows)
