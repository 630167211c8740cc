"""The knobs of one worker process (:class:`WorkerConfig`), read by every part of the worker."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WorkerConfig:
    """Knobs of one worker process."""

    model_name: str
    worker_id: str
    # Said of the model in its heartbeats, so that ingress's /v1/models can tell (e.g. "random weights").
    model_description: str = ""
    # How the model's chat output splits into reasoning and answer: auto (from the chat template), none, or a parser.
    reasoning_parser: str = "auto"
    # Requests taken from Kafka at one time, counted per tier and above (an interactive request is never
    # kept out by batch work): more than the engine's seats, so its fair queuing sees past a flood.
    max_in_flight: int = 64
    # Records of a tier fetched and held but not started yet, at most: the window past what runs in which the
    # intake starts tenants by tokens (``fair_intake``), so one tenant's backlog ahead in Kafka does not crowd out
    # another's. At least 1 (a tier holding nothing could fetch nothing).
    intake_hold: int = 256
    # Weights of the intake's fair queue by tenant (the engine's ``tenant_weights``); 1 when not named.
    tenant_weights: dict[str, float] = field(default_factory=dict)
    # While requests of a more important tier are held, those of less important tiers are held at most this many
    # (0: no such limit): batch intake and its output writes wait while interactive requests need the CPU.
    lower_tier_in_flight_while_busy: int = 0
    # While a more important tier is busy, the batch tier starts at most this many requests a second (0: unpaced).
    batch_rate_while_busy: float = 0.0
    # A tier counts as busy while it holds requests, and for this long after it last took one.
    busy_window_s: float = 2.0
    heartbeat_interval_s: float = 2.0
    stream_ttl_s: int = 3600
    drain_timeout_s: float = 30.0
    session_timeout_ms: int = 6000
    heartbeat_ms: int = 1500
    device: str = "cpu"
    # The engine runs batch-invariant (EngineSettings.deterministic); reported in the heartbeat.
    deterministic: bool = False
    redis_retry_max_s: float = 2.0
    commit_interval_s: float = 0.05
    # Keep flushed stream events until a Redis replica acknowledges them, re-appending them after a failover
    # (StreamPublisher); at most this many are kept.
    replica_ack: bool = False
    replica_ack_max_events: int = 50_000
    # The ingress instances' reader lease TTL (``readers``): a lapsed lease is looked for every third of it; 0: never.
    reader_lease_s: float = 15.0
    # With tenants apart, the tenants whose control topics (``llm.control.<tenant>``) the worker reads.
    tenants: tuple[str, ...] = ()
    # False (SLUICEGATE_METRICS_ENABLED): a Worker built without a WorkerTelemetry keeps none.
    metrics: bool = True
    # Publish the engine's KV-cache events on ``llm.kv_events`` (the engine journals them only then).
    kv_events: bool = False
