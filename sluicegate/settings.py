"""Process settings for every Sluicegate service, read from the environment (prefix ``SLUICEGATE_``).

One flat model on purpose: the configuration reference (docs/configuration.md) lists each field, and a service reads
only the fields it needs. Nested values use JSON (e.g. ``SLUICEGATE_TOPIC_PARTITIONS``).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """All knobs, with defaults that work for the local stack started by ``sluicegate dev up``."""

    model_config = SettingsConfigDict(env_prefix="SLUICEGATE_", extra="ignore")

    # --- backbone -----------------------------------------------------------------------------
    kafka_bootstrap: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers, comma-separated.")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL for streams, limits, state.")
    topic_prefix: str = Field(
        "", description="Prefix for every Kafka topic and Redis key (isolates tests and deployments)."
    )
    topic_partitions: int = Field(6, ge=1, description="Partitions per request topic created.")
    topic_replication: int = Field(1, ge=1, description="Replication factor for topics Sluicegate creates.")
    topic_replication_auto: bool = Field(
        True,
        description="Raise the replication of topics Sluicegate creates to min(3, brokers in the cluster), with "
        "min.insync.replicas 2 at 3 replicas, so one broker may fail without losing or refusing a write.",
    )

    # --- local dev stack ----------------------------------------------------------------------
    state_dir: Path = Field(
        Path(".sluicegate"), description="Folder for the local stack: Kafka jars, data, logs, pid files."
    )
    kafka_port: int = Field(9092, description="Port of the local Kafka broker (controller uses port + 1).")
    redis_port: int = Field(6379, description="Port of the local Redis server.")
    kafka_brokers: int = Field(
        1,
        ge=1,
        le=5,
        description="Brokers of the local Kafka (`sluicegate dev up --brokers N`): node i listens on kafka_port + 2i "
        "(controller + 1); from 3 brokers topics get 3 replicas and min.insync.replicas 2.",
    )
    kafka_full_jit: bool = Field(
        False,
        description="Let the local broker's JVM compile hot code with C2, as a production broker does, instead of "
        "C1 only: slower to start and busy compiling at first, then faster per request.",
    )

    # --- services -------------------------------------------------------------------------------
    ingress_port: int = Field(8000, description="HTTP port of the ingress API.")
    result_port: int = Field(8001, description="HTTP/WebSocket port of the result service.")
    public_stream_url: str = Field(
        "ws://127.0.0.1:8001", description="Base URL clients use to reach the result service."
    )
    api_keys: str = Field("", description="Comma-separated API keys accepted by ingress.")
    api_keys_file: Path | None = Field(
        None,
        description="Keys file: a key per line, or JSON lines (key, tenant, default_tier, max_tier, the key's limits "
        "and token quotas); a request asking a tier above its key's max_tier runs at max_tier.",
    )
    admin_api_keys: str = Field(
        "",
        description="Comma-separated API keys that are also admin keys (accepted like SLUICEGATE_API_KEYS): they may "
        'load and unload LoRA adapters. A keys-file entry is one with "admin": true.',
    )
    stream_token_secret: str = Field(
        "", description="HMAC secret for stream tokens; generated per `sluicegate up` when empty."
    )
    max_body_bytes: int = Field(1_000_000, ge=1024, description="Largest request body accepted (413 above).")
    stream_ttl_s: int = Field(3600, ge=1, description="Seconds a finished Redis stream is kept.")

    # --- worker -----------------------------------------------------------------------------------
    model: str = Field("", description="Model folder (or hub id) the worker serves.")
    model_name: str = Field(
        "", description="Public model name (defaults to the folder name, or a GGUF file's stem in lower case)."
    )
    model_description: str = Field(
        "", description="Said of the model in `/v1/models` (`description`), e.g. that its weights are random."
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="Device the worker's engine runs on.")
    worker_id: str = Field("", description="Worker identity in heartbeats (defaults to host-pid).")
    max_num_seqs: int = Field(64, ge=1, description="Most sequences the worker's engine runs at once.")
    max_num_batched_tokens: int = Field(2048, ge=16, description="Engine token budget per step.")
    stream_interval_ms: float = Field(
        5.0,
        ge=0,
        allow_inf_nan=False,
        description="A streaming request's tokens go out at most this often (its first token and its end at once): "
        "tokens made meanwhile share one stream event, so every hop after the engine handles fewer messages; 0 "
        "sends each engine step's token on its own (measured in docs/benchmarks.md).",
    )
    lower_tier_max_batched_tokens: int = Field(
        4,
        ge=0,
        description="Tokens a CPU engine's step gives the less important tiers together (decodes and prefill chunks) "
        "while a more important tier has work, so batch work never makes an interactive request wait behind a long "
        "step on shared cores; 0 means no cap. CUDA engines are not capped (unmeasured there).",
    )
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
    tenant_weights: dict[str, float] = Field(
        {},  # pydantic copies a mutable default per instance
        description='Relative share of a tier per tenant under contention, as JSON (e.g. {"acme": 2}); others weigh 1.',
    )
    kv_cache_gb: float = Field(1.0, gt=0, description="KV cache size on CPU workers (GiB).")
    dtype: str = Field("auto", description="Engine dtype: auto, float32, bfloat16, float16.")
    quantization: str = Field(
        "",
        description=(
            "Weight quantization: bnb-int8, bnb-nf4, fp8 (quantized at load), awq or gptq (INT4 checkpoints, "
            "also detected from config.json when empty); on the CPU, kept int8 / 4-bit through torch's CPU kernels: "
            "cpu-int8, cpu-int4, or gguf (a GGUF's own Q4_x / Q8_0 tensors); or empty."
        ),
    )
    attention_backend: str = Field("auto", description="Attention backend: auto, torch, triton, flash_attn.")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field(
        "auto",
        description="KV cache dtype: auto (the model's) or fp8 (= fp8_e4m3: e4m3 with per-layer, per-KV-head scales "
        "from the checkpoint or the first prompts; twice the blocks of a 16-bit cache; triton or torch backend).",
    )
    block_size: int = Field(16, ge=1, description="Tokens per KV-cache block (flash_attn needs a multiple of 256).")
    enable_prefix_caching: bool = Field(True, description="Reuse cached KV blocks of shared prompt prefixes.")
    enable_cascade_attention: bool = Field(
        True, description="Read a prefix shared by the whole decode batch once per step (CUDA, triton backend)."
    )
    enforce_eager: bool = Field(False, description="Run decode eagerly instead of through CUDA graphs.")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of GPU memory the engine may use (weights, activations, KV cache)."
    )
    max_model_len: int = Field(0, ge=0, description="Longest prompt + output in tokens; 0 means the model's own limit.")
    speculative_method: Literal["", "ngram", "draft_model"] = Field(
        "",
        description="Speculative decoding in the worker's engine: ngram (prompt lookup), draft_model (a smaller "
        "model drafts, SLUICEGATE_SPECULATIVE_MODEL) or empty (off).",
    )
    speculative_model: str = Field(
        "",
        description="Folder of the draft model for SLUICEGATE_SPECULATIVE_METHOD=draft_model: a smaller model "
        "with the served model's tokenizer.",
    )
    num_speculative_tokens: int = Field(4, ge=1, description="Draft tokens verified per decode step when speculating.")
    speculative_prompt_lookup_min: int = Field(1, ge=1, description="Shortest n-gram the ngram proposer matches.")
    speculative_prompt_lookup_max: int = Field(4, ge=1, description="Longest n-gram the ngram proposer matches.")
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Split the model over this many ranks (GPUs 0.. on CUDA, processes under gloo on CPU); 1 is "
        "off. A rank that dies fails the worker's engine, and its requests resume on another worker.",
    )
    engine_mode: Literal["auto", "process", "thread"] = Field(
        "auto",
        description="Where a worker runs the engine's step loop: a child process with its own GIL (auto, process) "
        "or a thread of the worker (thread).",
    )
    torch_threads: int = Field(0, ge=0, description="CPU threads for the engine's torch ops; 0 keeps torch's default.")
    engine_cpu_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="Niceness of a CPU engine's process, so that the worker's I/O, Redis and the relay (tokens "
        "already made) run first on shared cores; 0 keeps the worker's priority. CUDA engines are never niced.",
    )
    drain_timeout_s: float = Field(30.0, gt=0, description="Seconds a stopping worker waits for in-flight work.")
    heartbeat_interval_s: float = Field(2.0, gt=0, description="Seconds between worker heartbeats.")
    enable_lora: bool = Field(
        False,
        description="Serve LoRA adapters of the worker's model: requests naming an adapter, loaded on "
        "demand from the adapter registry; on by itself when SLUICEGATE_WORKER_LORAS names any.",
    )
    worker_loras: dict[str, str] = Field(
        {},  # pydantic copies a mutable default per instance
        description="LoRA adapters a worker registers (unless registered already) and loads at start, as JSON "
        '{"name": "path or fsspec URL"}; `sluicegate worker --lora NAME=PATH` adds to them.',
    )
    max_loras: int = Field(4, ge=1, description="LoRA adapters resident on the device at once (one slot each).")
    max_lora_rank: int = Field(16, ge=1, description="Largest LoRA rank the worker accepts.")
    max_cpu_loras: int = Field(
        0, ge=0, description="LoRA adapters kept in the CPU pool (least recently used evicted); 0 means 4 x max_loras."
    )
    lora_cache_dir: str = Field(
        "", description="Folder for LoRA adapters fetched from fsspec URLs; empty means <state_dir>/lora-cache."
    )

    # --- telemetry ----------------------------------------------------------------------------------
    log_level: str = Field("INFO", description="Log level for every service.")
    log_format: Literal["json", "kv"] = Field("kv", description="Structured log line format.")
    otlp_endpoint: str = Field(
        "",
        description="OTLP/HTTP endpoint for traces, an alias of OTEL_EXPORTER_OTLP_ENDPOINT (which wins); with "
        "neither (nor OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) set, tracing is off.",
    )
    metrics_enabled: bool = Field(
        True,
        description="False: no per-request metrics work (ingress's request middleware, the worker's metrics and "
        "engine hooks; /metrics still answers, emptier). A switch for measuring what the metrics cost; the worker "
        "keeps its telemetry while tracing is on (its request span lives there).",
    )
    worker_metrics_port: int = Field(
        8002, ge=0, le=65535, description="Port of a worker's /metrics, /healthz and /readyz; 0 disables them."
    )
    router_metrics_port: int = Field(
        8003, ge=0, le=65535, description="Port of the router stream processor's /metrics and /healthz; 0 disables."
    )
    batch_metrics_port: int = Field(
        8004, ge=0, le=65535, description="Port of a batch worker's /metrics (Celery worker); 0 disables it."
    )

    # --- ingress and router ---------------------------------------------------------------------------
    ingress_host: str = Field("0.0.0.0", description="Address the ingress API binds to.")
    ingress_count_prompt_tokens: bool = Field(
        True,
        description="Count each prompt with the tokenizer its workers publish and refuse prompt + max_tokens over "
        "the context at once (400); false leaves that check to the worker (an error event in the stream).",
    )
    served_models: str = Field(
        "",
        description="Comma-separated models ingress and the router accept even with no live worker (queued in "
        "Kafka); `up` adds the models it serves; the compose file names its demo model.",
    )
    allow_anonymous: bool = Field(
        False, description="Accept requests without an API key (tenant 'default'); for local demos only."
    )
    lora_check_timeout_s: float = Field(
        15.0,
        gt=0,
        description="Longest `POST /v1/load_lora_adapter` waits for a live worker of the base model to verify the "
        "adapter's files before it answers 503.",
    )
    lora_cache_ttl_s: float = Field(
        2.0,
        ge=0,
        description="Seconds ingress and the router reuse their snapshot of the LoRA adapter registry (another "
        "process's load or unload is seen within it; the process's own at once).",
    )
    cors_origins: str = Field(
        "",
        description="Extra comma-separated CORS origins for ingress and the result service's SSE relay (the result "
        "service's own is always allowed).",
    )
    kafka_timeout_s: float = Field(
        5.0, gt=0, description="Longest ingress waits for Kafka (publish ack, topic creation) before a 503."
    )
    ingress_producers: int = Field(
        2,
        ge=1,
        le=16,
        description="Kafka producers one ingress process publishes through. Each has one produce request in "
        "flight at a time, so a publish handed to a busy one waits for the previous acknowledgement.",
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Longest an OpenAI-style call waits for its result before it is cancelled."
    )
    request_record_ttl_s: int = Field(
        86400, ge=1, description="Seconds a request's status record and cancel marker are kept in Redis."
    )
    router_group: str = Field("sluicegate-router", description="Consumer group of the router stream processor.")
    router_prefix_chars: int = Field(2048, ge=1, description="Prompt characters hashed for prefix affinity.")
    router_prefix_tokens: int = Field(64, ge=1, description="Prompt token ids hashed for prefix affinity.")
    router_max_waiting: int = Field(
        8, ge=1, description="Waiting sequences at which a worker counts as overloaded for routing."
    )
    router_min_free_kv: float = Field(
        0.05, ge=0.0, le=1.0, description="Free KV-block fraction below which a worker counts as overloaded."
    )
    router_tenant_half_life_s: float = Field(
        30.0,
        ge=0.0,
        description="Half-life of the tokens per tenant and worker the router counts: when a worker is overloaded "
        "only tenants above an equal share of its recent tokens are diverted, the others keep their affinity; "
        "0 diverts every request as before.",
    )

    # --- response cache and model routes ------------------------------------------------------
    response_cache_ttl_s: int = Field(
        0,
        ge=0,
        description="Seconds a deterministic request's reply (temperature 0, or a seed) is kept in Redis and "
        "replayed to an identical request; 0 turns the response cache off.",
    )
    response_cache_shared: bool = Field(
        False, description="Share cached replies across tenants (by default each tenant has its own)."
    )
    response_cache_max_bytes: int = Field(
        1_000_000, ge=1024, description="Largest reply (its stream events, JSON) the response cache keeps."
    )

    # --- Responses API ---------------------------------------------------------------------------
    responses_ttl_s: int = Field(
        30 * 86400,
        ge=60,
        description="Seconds a stored response (store: true: its input, output and conversation, which "
        "previous_response_id continues) is kept in Redis after it is created; the event stream it can be "
        "replayed from is kept SLUICEGATE_STREAM_TTL_S after the response ends.",
    )
    responses_sweep_s: float = Field(
        5.0,
        gt=0,
        description="How often one ingress (a Redis lock elects it) saves the final object of stored responses "
        "that ended with no client reading them (background ones), before their event stream expires.",
    )

    routes_file: Path | None = Field(
        None,
        description="Routing file (YAML): public model names -> weighted, sticky versions, canaries with rollback, "
        "a fast path for short prompts; reloaded on change. `sluicegate routes check FILE` validates one.",
    )
    routes_reload_s: float = Field(
        1.0, gt=0, description="How often ingress, the router and batch workers check the routing file and rollbacks."
    )

    # --- worker reliability ---------------------------------------------------------------------------
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
    ingress_redis_timeout_s: float = Field(
        3.0,
        gt=0,
        description="Longest ingress waits for one Redis command before a 503 (a Redis that hangs answers nothing; "
        "not retried, unlike a refused connection).",
    )
    worker_redis_timeout_s: float = Field(
        5.0,
        gt=0,
        description="Socket timeout of a worker's Redis calls; a Redis that hangs counts as down and is retried.",
    )
    reader_lease_s: float = Field(
        15.0,
        ge=0,
        description="TTL of each ingress instance's reader lease in Redis, renewed every third of it. Workers stop "
        "an OpenAI-style request (its client cannot resume) once its ingress's lease is found missing at every check "
        "(a third of it apart) over half of it, and never start that ingress's requests still queued: an ingress "
        "that died mid-response leaves no generation running for nobody. Give ingress and workers the same value. "
        "0: no leases.",
    )

    # --- ingress admission control and per-key limits (a keys-file entry overrides the limit_* defaults) --------
    max_backlog_per_model: int = Field(
        1000,
        ge=0,
        description="Requests accepted but not started a model may hold (at or above a request's tier) before "
        "ingress answers 429; 0 disables the bound.",
    )
    backlog_cache_s: float = Field(
        1.0, gt=0, description="Seconds ingress reuses a model's backlog estimate (consumer lag) before re-reading it."
    )
    backlog_retry_after_s: int = Field(2, ge=1, description="Retry-After (seconds) of a 429 for a full backlog.")
    limit_rps: float = Field(0.0, ge=0, description="Default requests per second per API key; 0 means unlimited.")
    limit_rpm: int = Field(
        0,
        ge=0,
        description="Default requests per minute per API key, as a token bucket: a burst of that many, refilled "
        "evenly over the minute; 0 means unlimited.",
    )
    limit_tpm: int = Field(
        0, ge=0, description="Default tokens (prompt estimate + max_tokens) per minute per API key; 0 means unlimited."
    )
    limit_prompt_tokens: int = Field(
        0, ge=0, description="Default largest prompt per request, in estimated tokens; 0 means unlimited."
    )
    limit_max_tokens: int = Field(
        0, ge=0, description="Default largest max_tokens a request may ask for; 0 means unlimited."
    )
    default_queue_budget_s: float = Field(
        0.0,
        ge=0,
        le=365 * 86400,
        description="Default queue-time budget: a request without a deadline gets now + this; 0 means no deadline.",
    )

    # --- token quotas and the usage ledger (sluicegate.usage) -------------------------------------------------------
    limit_tokens_per_day: int = Field(
        0, ge=0, description="Default token quota per API key per UTC day (prompt + output); 0 means none."
    )
    limit_tokens_per_month: int = Field(0, ge=0, description="Default token quota per API key per UTC month; 0: none.")
    tenant_tokens_per_day: int = Field(0, ge=0, description="Default token quota per tenant per UTC day; 0: none.")
    tenant_tokens_per_month: int = Field(0, ge=0, description="Default token quota per tenant per UTC month; 0: none.")
    tenant_quotas: dict[str, dict[Literal["tokens_per_day", "tokens_per_month"], int]] = Field(
        {},
        description='Per-tenant token quotas over the tenant_tokens_* defaults, as JSON (e.g. {"acme": '
        '{"tokens_per_day": 100000, "tokens_per_month": 2000000}}; 0 means none).',
    )
    usage_rollup: bool = Field(
        True, description="Run the usage rollup (llm.usage -> per-tenant aggregates in Redis) in the router process."
    )
    usage_group: str = Field("sluicegate-usage", description="Consumer group of the usage rollup.")
    usage_dedup_ttl_s: int = Field(
        7 * 86400, ge=60, description="Seconds the rollup remembers a counted request id (duplicates are skipped)."
    )
    usage_retention_days: int = Field(400, ge=1, description="Days the hourly per-tenant usage aggregates are kept.")

    # --- Files and Batches API, and the Celery batch workers -------------------------------------------
    files_url: str = Field(
        "",
        description="Where uploaded and batch output files are stored: a folder or an fsspec URL (s3://..., "
        "memory://...); empty means <state_dir>/files.",
    )
    batch_broker_url: str = Field("", description="Celery broker of the batch workers; empty means the Redis URL.")
    batch_max_file_bytes: int = Field(
        200 * 1024 * 1024, ge=1024, description="Largest batch input file accepted (413 above), OpenAI's 200 MB."
    )
    batch_max_lines: int = Field(50_000, ge=1, description="Most lines a batch input file may hold (400 above).")
    batch_chunk_size: int = Field(200, ge=1, description="Batch lines published to Kafka per acknowledged chunk.")
    batch_max_in_flight: int = Field(
        2000,
        ge=1,
        description="Lines of one batch published and not yet finished before it waits: Kafka holds the backlog "
        "either way, this bounds what a cancel must take back.",
    )
    batch_worker_cpu_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="Niceness of a batch worker's process (validate, enqueue, collect): on cores shared with "
        "interactive serving it runs when they idle; 0 keeps normal priority.",
    )
    batch_tick_s: float = Field(1.0, gt=0, description="Seconds between the batch beat's ticks (advance, collect).")
    batch_visibility_timeout_s: int = Field(
        30,
        ge=5,
        description="Seconds before the broker re-delivers a task whose batch worker died (kill -9) without acking.",
    )
    batch_lock_ttl_s: float = Field(
        30.0, gt=0, description="Lifetime of a batch's (and the collector's) lock, so a dead holder frees it."
    )
    batch_cancel_grace_s: float = Field(
        5.0, ge=0, description="Seconds a cancelled batch waits for its in-flight lines' aborts before finishing."
    )
    batch_stall_check_s: float = Field(
        10.0,
        gt=0,
        description="Seconds without a new result after which a batch reads its outstanding lines' status records "
        "(lines that failed at the worker publish no result).",
    )
    batch_window_s: int = Field(
        86400, ge=1, description='Length of the "24h" completion window, in seconds (shorter for tests and demos).'
    )

    # --- the batch CLI (a client of ingress, like any OpenAI SDK user) ------------------------------------------
    api_base_url: str = Field(
        "",
        description="OpenAI base URL `sluicegate batch` talks to; empty means the local ingress "
        "(http://127.0.0.1:<ingress_port>/v1).",
    )
    api_key: str = Field(
        "", description="API key `sluicegate batch` sends when neither --api-key nor OPENAI_API_KEY is given."
    )

    @property
    def served_model_names(self) -> frozenset[str]:
        """``served_models`` as names (blanks and spaces around the commas dropped)."""
        return frozenset(comma_separated(self.served_models))

    @property
    def stream_token_lifetime_s(self) -> int:
        """Seconds a stream token stays valid after issue: the request's longest life (its status record and cancel
        marker are kept ``request_record_ttl_s``) plus the finished stream's retention (``stream_ttl_s``)."""
        return self.request_record_ttl_s + self.stream_ttl_s


def comma_separated(text: str) -> list[str]:
    """A comma-separated setting's items in order, each stripped, blanks dropped (``" a, ,b "`` -> ``["a", "b"]``)."""
    return [item.strip() for item in text.split(",") if item.strip()]


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()


def settings_table_markdown() -> str:
    """The configuration table of docs/configuration.md, generated from the fields above so it cannot drift."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        default = field.default
        shown = "(empty)" if default in ("", None) else f"`{default}`"
        rows.append(f"| `SLUICEGATE_{name.upper()}` | {shown} | {field.description or ''} |")
    return "\n".join(rows)
