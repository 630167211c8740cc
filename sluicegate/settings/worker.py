"""The GPU worker: the settings of a worker process, composed of the backbone, telemetry, what it agrees on with
the services in front of it, and its engine, plus its own fields (the model it serves, how it takes requests from
Kafka, commits and survives Redis failovers, its adapters to load and its probes' port)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .backbone import BackboneSettings
from .engine import EngineSettings
from .fleet import FleetSettings
from .kv_offload import KVOffloadSettings
from .state_dir import StateDirSettings
from .telemetry import TelemetrySettings


class WorkerSettings(
    BackboneSettings, StateDirSettings, TelemetrySettings, FleetSettings, EngineSettings, KVOffloadSettings
):
    """What a GPU worker process reads: no ingress, admission, routing or batch fields."""

    model: str = Field("", description="Model folder (or hub id) the worker serves.")
    model_name: str = Field(
        "", description="Public model name (defaults to the folder name, or a GGUF file's stem in lower case)."
    )
    model_description: str = Field(
        "", description="Said of the model in `/v1/models` (`description`), e.g. that its weights are random."
    )
    reasoning_parser: Literal["auto", "none", "qwen3", "deepseek_r1"] = Field(
        "auto",
        description="How the model's chat output splits into reasoning (`reasoning_content`) and answer: a "
        "`<think>...</think>` span opened by the model (qwen3) or by the chat template (deepseek_r1); auto: qwen3 "
        "when the chat template knows `</think>`, none otherwise.",
    )
    worker_id: str = Field("", description="Worker identity in heartbeats (defaults to host-pid).")
    worker_metrics_port: int = Field(
        8002, ge=0, le=65535, description="Port of a worker's /metrics, /healthz and /readyz; 0 disables them."
    )
    drain_timeout_s: float = Field(30.0, gt=0, description="Seconds a stopping worker waits for in-flight work.")

    # --- intake: what the worker takes from Kafka, per tier -------------------------------------------------------
    worker_lookahead: int = Field(
        0,
        ge=0,
        description="Requests a worker takes from Kafka at one time, counted per tier and above (batch work never "
        "keeps an interactive request out); more than max_num_seqs lets the engine's per-tenant fair queuing see past "
        "one tenant's flood. 0 means 4 x max_num_seqs.",
    )
    worker_intake_hold: int = Field(
        0,
        ge=0,
        description="Records of a tier a worker fetches past what it has started, at most (the rest wait in Kafka): "
        "it starts them tenant by tenant by tokens, so one tenant's backlog of long prompts ahead in Kafka does not "
        "crowd out another's (measured in docs/benchmarks.md). 0 means 8 x worker_lookahead.",
    )
    worker_lower_tier_lookahead_busy: int = Field(
        16,
        ge=0,
        description="Requests of less important tiers (batch) a CPU worker holds at most while a more important tier "
        "(interactive) is busy (see worker_busy_window_s); the rest wait in Kafka. 0 means only worker_lookahead "
        "applies. CUDA workers are not limited (unmeasured there).",
    )
    worker_batch_rate_busy: float = Field(
        10.0,
        ge=0,
        description="Batch-tier requests a CPU worker starts at most per second while a more important tier is busy, "
        "so the batch's CPU on shared cores (Kafka, Redis, results) never queues interactive requests; at full speed "
        "otherwise; none starts while such a request awaits its first token. 0 means unpaced. CUDA workers are not "
        "paced (unmeasured there).",
    )
    worker_busy_window_s: float = Field(
        2.0,
        gt=0,
        description="Seconds a tier counts as busy after the worker last took one of its requests (and while it holds "
        "any), for worker_lower_tier_lookahead_busy and worker_batch_rate_busy.",
    )

    # --- reliability ---------------------------------------------------------------------------------------------
    worker_session_timeout_ms: int = Field(
        6000,
        ge=1000,
        description="Worker consumer-group session timeout: how long a crashed worker's partitions wait before "
        "another worker takes them over (the broker's group.min.session.timeout.ms, 6000 by default, is the floor).",
    )
    worker_commit_interval_s: float = Field(
        0.05,
        ge=0,
        description="How long a worker gathers finished requests before committing their offsets in one request "
        "(0 commits after each). A crash re-delivers at most this window, and finished requests are recognised "
        "and skipped.",
    )
    worker_replica_ack: bool | None = Field(
        None,
        description="Keep each stream event a worker flushed until a Redis replica acknowledges it and re-append "
        "it after a failover, so an append the old primary never replicated is not lost; unset: on for "
        "redis+sentinel:// URLs, off otherwise.",
    )
    worker_replica_ack_max_events: int = Field(
        50_000, ge=1, description="Most stream events a worker keeps awaiting a replica (the oldest go first)."
    )
    worker_redis_timeout_s: float = Field(
        5.0,
        gt=0,
        description="Socket timeout of a worker's Redis calls; a Redis that hangs counts as down and is retried.",
    )

    # --- LoRA adapters it loads -----------------------------------------------------------------------------------
    worker_loras: dict[str, str] = Field(
        {},  # pydantic copies a mutable default per instance
        description="LoRA adapters a worker registers (unless registered already) and loads at start, as JSON "
        '{"name": "path or fsspec URL"}; `sluicegate worker --lora NAME=PATH` adds to them.',
    )
    lora_cache_dir: str = Field(
        "", description="Folder for LoRA adapters fetched from fsspec URLs; empty means <state_dir>/lora-cache."
    )
