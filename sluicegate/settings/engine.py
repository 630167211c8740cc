"""The engine a GPU worker runs: its device, batching, KV cache, attention, speculative decoding, tensor
parallelism and LoRA slots (all passed on as ``EngineConfig`` fields by ``gpu_workers.worker.main``), and how the
worker runs it (a process or a thread, its threads and priority). The engine itself never reads settings: it
takes its config from the worker."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import SettingsBase


class EngineSettings(SettingsBase):
    """Everything the worker hands its engine."""

    device: Literal["cpu", "cuda"] = Field("cpu", description="Device the worker's engine runs on.")
    dtype: str = Field("auto", description="Engine dtype: auto, float32, bfloat16, float16.")
    quantization: str = Field(
        "",
        description=(
            "Weight quantization: bnb-int8, bnb-nf4, fp8 (quantized at load), awq or gptq (INT4 checkpoints, "
            "also detected from config.json when empty); on the CPU, kept int8 / 4-bit through torch's CPU kernels: "
            "cpu-int8, cpu-int4, or gguf (a GGUF's own Q4_x / Q8_0 tensors); or empty."
        ),
    )
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
    tenant_weights: dict[str, float] = Field(
        {},  # pydantic copies a mutable default per instance
        description='Relative share of a tier per tenant under contention, as JSON (e.g. {"acme": 2}); others weigh 1.',
    )
    kv_cache_gb: float = Field(1.0, gt=0, description="KV cache size on CPU workers (GiB).")
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
    compile_cpu_decode: bool = Field(
        False,
        description="On the CPU, run pure decode steps as one graph compiled by torch.compile (the layers' small "
        "ops fused; 1.2-1.4x the eager step on the default model). Compiles at start (about 1.5 min on two cores "
        "the first time, seconds once TORCHINDUCTOR_CACHE_DIR holds it) and needs a C++ compiler; without one "
        "the engine stays eager. `sluicegate up` turns it on for CPU workers.",
    )
    lm_head_quantization: Literal["", "w8a8"] = Field(
        "",
        description="On the CPU, w8a8: the LM head as int8 weights times int8 activations quantized per row, one "
        "integer GEMM (a decode step 1.2-1.3x faster than with a bfloat16 head on the default model; top-1 agreement "
        "and perplexity in docs/quality.md). Empty: the head stays as the weights' quantization leaves it. "
        "`sluicegate up` turns it on for CPU workers of models kept quantized.",
    )
    cpu_int4_activations: Literal["bfloat16", "int8", "auto"] = Field(
        "auto",
        description="On the CPU, what layers kept in 4 bits multiply by. int8: activations quantized per group of "
        "32 (as llama.cpp does) and integer dot products, in a kernel built at start with the C++ compiler: 0.43x "
        "the time of torch's int4 kernel at one row on AVX2, 0.80x with AVX-512 VNNI, about half at eight rows. "
        "bfloat16: torch's int4 kernel, more precise (its perplexity about 2.5 % lower). auto: int8 wherever torch "
        "dispatches to AVX2 or AVX-512 and the kernel builds, bfloat16 elsewhere.",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of GPU memory the engine may use (weights, activations, KV cache)."
    )
    max_model_len: int = Field(0, ge=0, description="Longest prompt + output in tokens; 0 means the model's own limit.")
    deterministic: bool = Field(
        False,
        description="Batch-invariant execution: a request's greedy and seeded tokens do not depend on what it is "
        "batched with, chunk boundaries, prefix-cache hits, preemption or which worker of the same build, CPU "
        "family, torch threads and SLUICEGATE_COMPILE_CPU_DECODE serves it, at a cost in speed "
        "(docs/benchmarks.md). On the CPU with the torch attention backend (with compiled steps, every step "
        "through the compiled graph), or on CUDA with batch-invariant Triton kernels (the triton backend, "
        "unquantized); workers report it in their heartbeats and /v1/models shows it per model, warning when "
        "a model's workers mix modes or compute differently.",
    )

    # --- speculative decoding ------------------------------------------------------------------------------------
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

    # --- parallelism and the engine's process --------------------------------------------------------------------
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
    cpu_prefill_threads: int = Field(
        0,
        ge=0,
        description="On the CPU, torch threads for the engine's steps that take in prompt tokens (prefill, mixed); "
        "decode steps keep SLUICEGATE_TORCH_THREADS. A prefill is a few long products that a second thread nearly "
        "halves, where a decode step's many short ones lose to waiting on shared cores. 0: the same for every step. "
        "`sluicegate up` gives prefills each engine's share of all cores. Ignored under SLUICEGATE_DETERMINISTIC, "
        "which keeps one thread count for every step.",
    )
    engine_cpu_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="Niceness of a CPU engine's process, so that the worker's I/O, Redis and the relay (tokens "
        "already made) run first on shared cores; 0 keeps the worker's priority. CUDA engines are never niced.",
    )
    engine_cpu_wait_policy: Literal["passive", "active", "inherit"] = Field(
        "passive",
        description="OMP_WAIT_POLICY of a CPU engine's process (engine_mode process): passive puts a torch thread "
        "that waits for its peers to sleep at once rather than spin, so a preempted peer (the worker, Kafka or "
        "another engine on the same cores) does not stall every parallel op; inherit leaves the environment's. "
        "An OMP_WAIT_POLICY set in the environment wins.",
    )

    # --- LoRA slots ------------------------------------------------------------------------------------------------
    enable_lora: bool = Field(
        False,
        description="Serve LoRA adapters of the worker's model: requests naming an adapter, loaded on "
        "demand from the adapter registry; on by itself when SLUICEGATE_WORKER_LORAS names any.",
    )
    max_loras: int = Field(4, ge=1, description="LoRA adapters resident on the device at once (one slot each).")
    max_lora_rank: int = Field(16, ge=1, description="Largest LoRA rank the worker accepts.")
    max_cpu_loras: int = Field(
        0, ge=0, description="LoRA adapters kept in the CPU pool (least recently used evicted); 0 means 4 x max_loras."
    )
