"""Offline entry point shaped like vLLM's ``LLM``: build once, ``generate`` over many prompts."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from ..config import EngineConfig
from ..core.request import EngineRequest, PromptInput
from ..kv_offload import KVOffloadConfig
from ..llm_engine import LLMEngine
from ..lora.request import LoRARequest
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..spec_decode.config import SpeculativeConfig


def normalize_prompts(prompts: PromptInput | SequenceABC[PromptInput]) -> list[PromptInput]:
    """One prompt (a string or a list of ids) or a list of prompts -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # type: ignore[arg-type]
        return [p if isinstance(p, str) else list(p) for p in prompts]  # type: ignore[union-attr]
    raise ValueError("prompts must be a string, a list of token ids, or a list of those")


class LLM:
    """Load a model and tokenizer from a Hugging Face folder and generate with continuous batching."""

    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "cpu",
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        num_kv_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        cpu_kv_cache_gb: float = 2.0,
        attention_backend: str = "auto",
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        enforce_eager: bool = False,
        compile_cpu_decode: bool = False,
        lm_head_quantization: str | None = None,
        cpu_int4_activations: str = "bfloat16",
        cpu_prefill_threads: int = 0,
        enable_cascade_attention: bool = True,
        seed: int = 0,
        tenant_weights: dict[str, float] | None = None,
        speculative_config: SpeculativeConfig | dict[str, Any] | None = None,
        tensor_parallel_size: int = 1,
        tensor_parallel_timeout_s: float = 60.0,
        enable_lora: bool = False,
        max_loras: int = 4,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        stream_interval_ms: float = 0.0,
        enable_kv_events: bool = False,
        kv_offload: KVOffloadConfig | dict[str, Any] | None = None,
        deterministic: bool = False,
    ) -> None:
        config = EngineConfig(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            device=device,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            num_kv_blocks=num_kv_blocks,
            gpu_memory_utilization=gpu_memory_utilization,
            cpu_kv_cache_gb=cpu_kv_cache_gb,
            attention_backend=attention_backend,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            deterministic=deterministic,
            enforce_eager=enforce_eager,
            compile_cpu_decode=compile_cpu_decode,
            lm_head_quantization=lm_head_quantization,
            cpu_int4_activations=cpu_int4_activations,
            cpu_prefill_threads=cpu_prefill_threads,
            enable_cascade_attention=enable_cascade_attention,
            seed=seed,
            tenant_weights=dict(tenant_weights or {}),
            speculative_config=speculative_config,
            tensor_parallel_size=tensor_parallel_size,
            tensor_parallel_timeout_s=tensor_parallel_timeout_s,
            enable_lora=enable_lora,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras,
            stream_interval_ms=stream_interval_ms,
            enable_kv_events=enable_kv_events,
            kv_offload=kv_offload,
        )
        self.engine = LLMEngine(config)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check and load a LoRA adapter (CPU pool); True when newly loaded; ``LoRAError`` for a bad adapter."""
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter; False when it is not loaded."""
        return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        """Adapters loaded on this engine (CPU pool or device)."""
        return self.engine.list_loras()

    def score(self, prompt: PromptInput, prefill_len: int | None = None, step_len: int = 1) -> torch.Tensor:
        """Float32 logits ``[num_tokens, vocab]`` of every position of one prompt (row ``i`` predicts token
        ``i + 1``), for teacher-forced quality measures; see ``LLMEngine.score``."""
        return self.engine.score(prompt, prefill_len, step_len)

    def embed(
        self,
        prompts: PromptInput | SequenceABC[PromptInput],
        pooling: str = "last",
        priority: int = 0,
        tenant: str = "default",
    ) -> list[list[float]]:
        """One L2-normalized embedding per prompt, in input order: the final normed hidden state of the last
        prompt token (``pooling="last"``, vLLM's default for decoder models) or the mean over every prompt
        token (``"mean"``). Each prompt is a prefill-only request, computed in full (never from the prefix
        cache), batched with whatever else the engine runs."""
        outputs = self._run(
            [
                self.engine.admit(EngineRequest.build(p, priority=priority, tenant=tenant, pooling=pooling))
                for p in normalize_prompts(prompts)
            ]
        )
        return [output.embedding or [] for output in outputs]

    def generate(
        self,
        prompts: PromptInput | SequenceABC[PromptInput],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        priority: int = 0,
        tenant: str = "default",
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in input order.

        ``sampling_params`` is one ``SamplingParams`` for all prompts or a list of the same length; ``priority``
        is the scheduling tier of them all (lower runs first). ``lora_request``: one adapter for every prompt, or
        one per prompt (None: the base model), as vLLM takes it.
        Every request is validated before any is queued, so a bad one leaves the engine untouched.
        """
        prompt_list = normalize_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts; "
                    "pass one SamplingParams or one per prompt"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list: list[LoRARequest | None] = [lora_request] * len(prompt_list)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(lora_list)} LoRA requests for {len(prompt_list)} prompts; pass one or one per prompt"
                )
        # Admitted one by one first: a bad request raises before any of them is queued.
        requests = [
            self.engine.admit(EngineRequest.build(p, sp, priority=priority, tenant=tenant, lora_request=lora))
            for p, sp, lora in zip(prompt_list, params_list, lora_list, strict=True)
        ]
        # Adapters load before anything is queued, so a bad one leaves the engine untouched too.
        for lora in dict.fromkeys(r for r in lora_list if r is not None):
            self.engine.add_lora(lora)
        return self._run(requests)

    def _run(self, requests: list[EngineRequest]) -> list[RequestOutput]:
        """Queue admitted requests, step until every choice of each has finished; outputs in request order."""
        for request in requests:
            self.engine.submit(request)
        pending = {request.request_id for request in requests}
        choices_left = {request.request_id: request.params.n for request in requests}
        results: dict[str, list[RequestOutput]] = {request.request_id: [] for request in requests}
        try:
            while pending:
                for delta in self.engine.step():
                    if delta.final is not None and delta.request_id in pending:
                        results[delta.request_id].append(delta.final)
                        choices_left[delta.request_id] -= 1
                        if choices_left[delta.request_id] == 0:
                            pending.discard(delta.request_id)
        finally:
            # An exception mid-run (e.g. KeyboardInterrupt) must not leave requests holding blocks.
            for request_id in pending:
                self.engine.abort(request_id)
        outputs = []
        for request in requests:
            # One output per prompt: choice 0, carrying every choice (n > 1) in ``choices``, by index.
            choices = sorted(results[request.request_id], key=lambda o: o.index)
            choices[0].choices = choices
            outputs.append(choices[0])
        return outputs
