"""Engine configuration: one validated dataclass holding every knob the engine reads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .kv_offload.config import KVOffloadConfig
from .spec_decode.config import SpeculativeConfig

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

KNOWN_ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")


def parse_dtype(value: str | torch.dtype) -> torch.dtype | None:
    """Map a user dtype spelling onto a torch dtype; ``"auto"`` maps to ``None`` (resolved at load)."""
    if isinstance(value, torch.dtype):
        if value not in _DTYPE_NAMES.values():
            raise ValueError(f"unsupported dtype {value}; use float32, bfloat16 or float16")
        return value
    name = str(value).lower().removeprefix("torch.")
    if name == "auto":
        return None
    if name not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {value!r}; use 'auto', 'float32', 'bfloat16' or 'float16'")
    return _DTYPE_NAMES[name]


@dataclass
class EngineConfig:
    """Construction arguments of ``LLM``/``AsyncEngine``; checked once in ``__post_init__``.

    ``num_kv_blocks=None`` sizes the paged KV cache from free memory: on CUDA a
    ``gpu_memory_utilization`` share of device memory minus what the weights and a profiled
    forward pass use; on CPU ``cpu_kv_cache_gb`` GiB, never more than ``max_num_seqs`` full-length
    sequences need.
    """

    model: str
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    device: str | torch.device = "cpu"
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 2.0
    attention_backend: str = "auto"
    # Weights: "bnb-int8" / "bnb-nf4" / "fp8" quantize a float checkpoint at load; "awq" / "gptq" name an INT4
    # checkpoint's method (None detects it from config.json's quantization_config; quantization/int4_load.py).
    # CPU only, kept quantized through torch's CPU kernels (quantization/cpu_quant.py; dtype "auto" -> bfloat16):
    # "cpu-int8" / "cpu-int4" every projection int8 per channel / 4-bit in groups of 32 (a GGUF's 4-bit blocks
    # and an AWQ / GPTQ checkpoint's INT4 taken as they are), "gguf" a GGUF file's own Q4_x / Q8_0 tensors.
    quantization: str | None = None
    # "auto": the cache in the model's dtype; "fp8" / "fp8_e4m3": float8_e4m3fn with per-layer,
    # per-KV-head scales from the checkpoint or the first prompts (attention/kv_quant.py).
    kv_cache_dtype: str = "auto"
    # Decode steps replay CUDA graphs on CUDA unless True (on CPU graphs are never used).
    enforce_eager: bool = False
    # On the CPU, pure decode steps run as one graph compiled by torch.compile (execution/cpu_decode_compile.py):
    # the layers' small ops fused, at the cost of compiling at start (cached on disk). Needs a C++ compiler.
    compile_cpu_decode: bool = False
    # On the CPU, "w8a8": the LM head as int8 weights times int8 activations quantized per row, one integer GEMM
    # (quantization/cpu_w8a8.py; several times faster than a bfloat16 head at decode). None: the head stays as the
    # weights' method leaves it (float; a GGUF's own blocks under "gguf").
    lm_head_quantization: str | None = None
    # On the CPU, what the kept 4-bit layers multiply by (quantization/cpu_int4_q8.py): "bfloat16" (torch's int4
    # kernel), "int8" (activations quantized per group of 32, integer dot products; half torch's kernel's time at
    # one row on AVX2), or "auto" (int8 where torch dispatches to AVX2, where it was measured faster; else bfloat16).
    cpu_int4_activations: str = "bfloat16"
    # On the CPU, torch threads for steps that take in prompt tokens (prefill, mixed); decode steps keep the
    # process's count (execution/cpu_step_threads.py). 0: the same count for every step.
    cpu_prefill_threads: int = 0
    # Decode batches sharing a long prefix attend it once (backends with a cascade path: triton).
    enable_cascade_attention: bool = True
    # Models mixing full and sliding-window layers (Gemma 3) keep one block table and pool per layer group, so
    # sliding layers hold only their window (core/kv_groups.py); False keeps every block of every layer.
    enable_hybrid_kv_cache: bool = True
    seed: int = 0
    # Relative share of a tier's throughput per tenant under contention; tenants not listed weigh 1.
    tenant_weights: dict[str, float] = field(default_factory=dict)
    # While a more important tier has unfinished work, the less important tiers together compute at most this
    # many tokens a step (decodes and prefill chunks), so its steps stay short; None: no cap.
    lower_tier_max_batched_tokens: int | None = None
    # Speculative decoding (off when None): a ``SpeculativeConfig`` or a dict of its fields, as vLLM takes it.
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None
    # Tensor parallelism: the model split over this many ranks (one process each: GPUs 0.. on CUDA, gloo on
    # CPU); rank 0 schedules and samples. A collective waiting longer than the timeout fails the step.
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 60.0
    # Multi-LoRA (lora/): up to ``max_loras`` adapters of rank <= ``max_lora_rank`` in device slots at once, and
    # ``max_cpu_loras`` (None: 4 x max_loras) loaded on the CPU, least recently used evicted first.
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # A running request's next delta waits until this long after its last one (its first token and its end go at
    # once); what it makes meanwhile rides in that delta. 0: a delta every step. vLLM's ``stream_interval`` counts
    # tokens; a time suits a stream read by people and costs per message downstream whatever the model's speed.
    stream_interval_ms: float = 0.0
    # Journal the prefix cache's changes (blocks cached, evicted) for whoever drains them each step
    # (``LLMEngine.take_kv_events``): a worker publishing them to a fleet router. Off, nothing is kept.
    enable_kv_events: bool = False
    # Offload tiers under the prefix cache (host memory, local disk, a shared store): a ``KVOffloadConfig`` or a
    # dict of its fields; None or all tiers at 0: off. Needs prefix caching.
    kv_offload: KVOffloadConfig | dict[str, Any] | None = None
    # Batch-invariant execution (execution/batch_invariant.py): a request's greedy and seeded tokens do not depend
    # on what it is batched with, chunk boundaries, prefix-cache hits or preemption, at a cost in speed. CPU only.
    deterministic: bool = False
    torch_dtype: torch.dtype | None = field(init=False, default=None)
    # The cache's dtype when it is not the model's (float8_e4m3fn), else None.
    kv_cache_torch_dtype: torch.dtype | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, Path)) or not str(self.model):
            raise ValueError("model must be a local Hugging Face folder or a hub id")
        self.model = str(self.model)
        self.torch_dtype = parse_dtype(self.dtype)
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        self.kv_offload = KVOffloadConfig.from_value(self.kv_offload)
        self.device = torch.device(self.device)
        self._check_cpu_quantization()
        self._check_lm_head()
        self._check_int4_activations()
        if isinstance(self.cpu_prefill_threads, bool) or not isinstance(self.cpu_prefill_threads, int):
            raise ValueError(f"cpu_prefill_threads must be an int, got {self.cpu_prefill_threads!r}")
        if self.cpu_prefill_threads < 0:
            raise ValueError(f"cpu_prefill_threads must be >= 0 (0: as decode steps), got {self.cpu_prefill_threads}")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but CUDA is not available")
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"unsupported device {self.device}; use 'cpu' or 'cuda'")
        _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if self.lower_tier_max_batched_tokens is not None:
            _positive("lower_tier_max_batched_tokens", self.lower_tier_max_batched_tokens)
        if not 0.0 <= self.stream_interval_ms < math.inf:
            raise ValueError(f"stream_interval_ms must be a finite number >= 0, got {self.stream_interval_ms}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kv_cache_gb <= 0:
            raise ValueError(f"cpu_kv_cache_gb must be > 0, got {self.cpu_kv_cache_gb}")
        if self.attention_backend not in KNOWN_ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention_backend {self.attention_backend!r}; "
                f"choose one of {', '.join(KNOWN_ATTENTION_BACKENDS)}"
            )
        from .attention.kv_quant import parse_kv_cache_dtype

        self.kv_cache_torch_dtype = parse_kv_cache_dtype(self.kv_cache_dtype)
        if self.attention_backend == "flash_attn" and self.kv_cache_torch_dtype is not None:
            from .attention.flash_attn_backend import FP8_KV_REFUSAL

            raise ValueError(FP8_KV_REFUSAL)
        if self.attention_backend == "flash_attn":
            from .attention.flash_attn_backend import flash_attn_block_size_problem

            # Checked here, before any weights load; the device and package are checked with the backend.
            problem = flash_attn_block_size_problem(self.block_size)
            if problem is not None:
                raise ValueError(problem)
        self._check_tensor_parallel()
        self._check_lora()
        for flag in (
            "enforce_eager",
            "compile_cpu_decode",
            "enable_cascade_attention",
            "enable_hybrid_kv_cache",
            "enable_lora",
            "deterministic",
        ):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        self._check_deterministic()
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if not isinstance(self.tenant_weights, dict):
            raise ValueError(f"tenant_weights must be a dict of tenant -> weight, got {self.tenant_weights!r}")
        for tenant, weight in self.tenant_weights.items():
            if not isinstance(tenant, str) or not tenant:
                raise ValueError(f"tenant_weights keys must be non-empty strings, got {tenant!r}")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
                raise ValueError(f"weight of tenant {tenant!r} must be a positive finite number, got {weight!r}")

    def _check_cpu_quantization(self) -> None:
        """The CPU kept-quantized methods (``cpu-int8``, ``cpu-int4``, ``gguf``) are refused off the CPU here,
        before anything loads (and before a missing CUDA is reported: the method is the first thing to fix)."""
        from .quantization.cpu_quant import CPU_QUANTIZATIONS, cpu_quantization_problem

        if self.quantization in CPU_QUANTIZATIONS:
            problem = cpu_quantization_problem(self.quantization, self.device)
            if problem is not None:
                raise ValueError(problem)

    def _check_lm_head(self) -> None:
        """``lm_head_quantization`` is known and can run here, checked before anything loads."""
        if self.lm_head_quantization is None:
            return
        from .quantization.cpu_w8a8 import LM_HEAD_QUANTIZATIONS, w8a8_problem

        method = self.lm_head_quantization
        if method not in LM_HEAD_QUANTIZATIONS:
            raise ValueError(f"unknown lm_head_quantization {method!r}; use one of {LM_HEAD_QUANTIZATIONS} or None")
        if self.device.type != "cpu":
            raise ValueError(
                f"lm_head_quantization={method!r} runs torch's CPU integer GEMM and needs device='cpu', "
                f"not {str(self.device)!r}"
            )
        if self.tensor_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size > 1 does not support lm_head_quantization={method!r} yet")
        problem = w8a8_problem()
        if problem is not None:
            raise ValueError(f"lm_head_quantization={method!r} cannot run: {problem}")

    def _check_int4_activations(self) -> None:
        """``cpu_int4_activations`` is known, and "int8" can run here (its kernel built once, before loading)."""
        from .quantization import cpu_int4_q8

        value = self.cpu_int4_activations
        if value not in cpu_int4_q8.ACTIVATIONS:
            raise ValueError(f"unknown cpu_int4_activations {value!r}; use one of {cpu_int4_q8.ACTIVATIONS}")
        if value != "int8":
            return
        if self.device.type != "cpu":
            raise ValueError(f"cpu_int4_activations='int8' runs a CPU kernel and needs device='cpu', not {self.device}")
        problem = cpu_int4_q8.problem()
        if problem is not None:
            raise ValueError(f"cpu_int4_activations='int8' cannot run: {problem}")

    def _check_tensor_parallel(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if not self.tensor_parallel_timeout_s > 0:
            raise ValueError(f"tensor_parallel_timeout_s must be > 0, got {self.tensor_parallel_timeout_s}")
        if self.tensor_parallel_size == 1:
            return
        # Combinations whose shards or scales are not split per rank yet: refused by name, not run wrong.
        if self.quantization is not None:
            raise ValueError(f"tensor_parallel_size > 1 does not support quantization={self.quantization!r} yet")
        if self.kv_cache_torch_dtype is not None:
            raise ValueError("tensor_parallel_size > 1 does not support an FP8 KV cache yet")
        if self.offload_tiers is not None:
            # Each rank holds its heads' share of every block, in its own process.
            raise ValueError("tensor_parallel_size > 1 does not support KV offload tiers yet")
        spec = self.speculative_config
        if isinstance(spec, SpeculativeConfig) and spec.method == "draft_model":
            raise ValueError("tensor_parallel_size > 1 does not support a draft model yet (ngram works)")
        if self.device.type == "cuda" and torch.cuda.device_count() < self.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} needs as many GPUs; "
                f"{torch.cuda.device_count()} visible"
            )

    def _check_deterministic(self) -> None:
        """Refuse by name what the deterministic mode (execution/batch_invariant.py) cannot keep batch-invariant yet,
        before anything loads."""
        if not self.deterministic:
            return
        problem = None
        if self.device.type == "cuda":
            # Batch-invariant Triton kernels (execution/batch_invariant_triton.py) replace the dense matmuls and
            # RMSNorms; quantized GPU layers keep their own kernels, whose reductions follow the batch.
            if self.attention_backend == "auto":
                self.attention_backend = "triton"
            self.enable_cascade_attention = False  # the fixed-split attention covers the whole context itself
            if self.attention_backend != "triton":
                problem = f"needs the triton attention backend on the GPU, not {self.attention_backend!r}"
            elif self.quantization is not None:
                problem = (
                    f"does not support quantization={self.quantization!r} on the GPU yet (its kernels are not "
                    "batch-invariant)"
                )
            elif self.enable_lora:
                problem = "does not support LoRA on the GPU yet (its batched adapter matmuls are not batch-invariant)"
        elif self.device.type != "cpu":
            problem = f"runs on the CPU or CUDA, not {self.device.type!r}"
        elif self.attention_backend not in ("auto", "torch"):
            problem = f"needs the torch attention backend on the CPU, not {self.attention_backend!r}"
        elif self.tensor_parallel_size > 1:
            problem = "does not support tensor_parallel_size > 1 yet (the all-reduce splits the sums)"
        elif isinstance(self.speculative_config, SpeculativeConfig) and self.speculative_config.method == "draft_model":
            problem = "does not support a draft model yet (its own forward is not batch-invariant); ngram works"
        if problem is not None:
            raise ValueError(f"deterministic=True {problem}")

    def _check_lora(self) -> None:
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = 4 * self.max_loras
        _positive("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.enable_lora and self.tensor_parallel_size > 1:
            # The slot stacks would have to be split per rank like the projections they add to.
            raise ValueError("enable_lora does not support tensor_parallel_size > 1 yet")

    @property
    def offload_tiers(self) -> KVOffloadConfig | None:
        """The offload tiers to build: the config when any tier is on and prefix caching is, else None."""
        tiers = self.kv_offload
        if isinstance(tiers, KVOffloadConfig) and tiers.enabled and self.enable_prefix_caching:
            return tiers
        return None

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
