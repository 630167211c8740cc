"""The synchronous engine loop: take ``EngineRequest``s, run one scheduling + forward + sampling step at a
time, apply stop rules, and report per-request deltas. Not thread-safe: every front end drives it from one
thread (``LLM`` the caller's, ``AsyncEngine`` its step thread, ``ProcessEngine`` its engine process).

The driver stands above everything it drives: the leaf state and bookkeeping of ``core/`` (scheduler, KV block
manager, sequences, requests), the forward pass of ``execution/`` (or ``distributed/``'s tensor-parallel one),
``spec_decode/`` and ``lora/``. None of those imports it; only the front ends of ``entrypoints/`` do."""

from __future__ import annotations

import logging
import time

import torch

from . import kv_journal
from .attention import get_attention_backend
from .config import EngineConfig
from .core.admission import RequestValidator
from .core.choices import fork_choices
from .core.deltas import check_stop, delta_due, make_delta
from .core.request import EngineRequest, PromptInput
from .core.scheduler import Scheduler
from .core.sequence import RequestStatus, Sequence
from .core.sequence_factory import SequenceFactory
from .distributed.ranks import TensorParallelRanks, TPModelRunner
from .execution.batch_invariant import make_batch_invariant
from .execution.model_runner import ModelRunner
from .execution.sampler import Sampler
from .kv_cache_setup import attach_offloader, build_kv_cache
from .lora.manager import LoRAManager
from .lora.peft_files import AdapterSpec, load_adapter
from .lora.request import LoRARequest
from .models.loader import load_model
from .outputs import EngineStats, KVCacheEvents, RequestDelta
from .sampling_params import SamplingParams
from .spec_decode.draft_model import build_draft_model
from .spec_decode.speculator import Speculator
from .tokenizer import load_tokenizer, resolve_eos_token_ids

logger = logging.getLogger(__name__)


class LLMEngine:
    """Continuous batching over a paged KV cache: ``submit`` (or ``add_request``) queues, ``step`` steps."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._stream_interval_s = config.stream_interval_ms / 1000
        # Tensor parallelism: ranks 1.. start first (they load their shards while this rank loads its own).
        self.tp_ranks = TensorParallelRanks(config) if config.tensor_parallel_size > 1 else None
        self.loaded = load_model(config, self.tp_ranks.group if self.tp_ranks else None)
        self.device = torch.device(config.device)
        self.tokenizer = load_tokenizer(config.tokenizer or self.loaded.path)
        eos_token_ids = resolve_eos_token_ids(self.loaded.path, self.loaded.hf_config, self.tokenizer)
        self.max_model_len = self.loaded.max_model_len
        self.architecture = self.loaded.architecture
        self.vocab_size = self.loaded.vocab_size
        self.validator = RequestValidator(
            self.tokenizer, self.vocab_size, self.max_model_len, config.enable_lora,
            refused_tokens=self.loaded.model.refused_prompt_tokens(),
        )  # fmt: skip
        # LoRA layers wrap the projections before the cache is sized, so their slot stacks count as used memory.
        self.lora = LoRAManager.for_engine(self.loaded, config) if config.enable_lora else None
        block_size = config.block_size
        kv_dtype = config.kv_cache_torch_dtype
        backend = get_attention_backend(config.attention_backend, self.device, block_size, self.loaded.dtype, kv_dtype)
        if self.tp_ranks is not None:
            self.runner: ModelRunner = TPModelRunner(self.loaded, backend, block_size, kv_dtype, self.tp_ranks.group)
        else:
            self.runner = ModelRunner(self.loaded, backend, block_size, kv_dtype)
        self.runner.lora = self.lora
        if config.deterministic and self.device.type == "cuda":
            from .execution.batch_invariant_triton import make_batch_invariant_cuda  # triton: CUDA engines only

            make_batch_invariant_cuda(self.loaded.model, backend)
        elif config.deterministic:
            make_batch_invariant(self.loaded.model, backend)
        spec = config.speculative_config
        # A draft model loads before the cache is sized: its weights count as used memory, and its own cache
        # takes one block for each of the target's (the same token capacity), so the budget is split per block.
        draft = build_draft_model(spec, config, self.max_model_len, self.vocab_size, self.tokenizer)
        self.block_manager = build_kv_cache(config, self.loaded, self.runner, draft, self.tp_ranks is not None)
        # Cascade attention and decode CUDA graphs (captured here: they bind the cache's addresses).
        self.runner.setup_decode(config, self.max_model_len)
        self.block_manager.record_kv_events = config.enable_kv_events and config.enable_prefix_caching
        self.offloader = attach_offloader(config, self.runner, self.loaded.dtype, self.block_manager)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.tenant_weights,
            lower_tier_max_batched_tokens=config.lower_tier_max_batched_tokens,
            lora=self.lora,
        )
        self.sampler = Sampler(config.seed, self.device)
        self.speculator = Speculator(spec, self.max_model_len, draft) if spec is not None else None
        self.sequences = SequenceFactory(
            self.tokenizer, eos_token_ids, self.vocab_size, self.max_model_len, self.device
        )
        # Each request's unfinished sequences: one per choice still generating (n > 1 forks siblings).
        self._requests: dict[str, list[Sequence]] = {}
        self.num_steps = 0

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokens that end a request (from ``generation_config.json`` or the tokenizer); new sequences stop on
        them unless ``ignore_eos``."""
        return self.sequences.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.sequences.eos_token_ids = ids

    @property
    def attention_backend_name(self) -> str:
        return self.runner.backend.name

    @property
    def arithmetic(self) -> str:
        """What this engine's numbers depend on besides the model's files: device, how steps run, thread count,
        precision, torch. Two deterministic engines give a request the same bits only when these are equal."""
        config, device = self.config, self.device
        if device.type == "cpu":
            steps = "compiled" if self.runner.compiled_decode is not None else "eager"
            place = f"cpu {steps} steps, {torch.get_num_threads()} threads"
        else:
            place = f"{device.type} {self.attention_backend_name} attention"
        precision = f"{self.loaded.dtype}".removeprefix("torch.")
        if config.quantization:
            precision += f" {config.quantization}"
        if self.loaded.int8_activation_layers:
            precision += ", int4 layers on int8 activations"
        if config.lm_head_quantization:
            precision += f", {config.lm_head_quantization} head"
        return f"{place}, {precision}, torch {torch.__version__}"

    # ------------------------------------------------------------------ adapters
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check and load a LoRA adapter into the CPU pool; True when newly loaded. ``LoRAError`` (a ValueError)
        for an adapter the engine cannot use; ``ValueError`` without ``enable_lora``."""
        return self._lora_manager().add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter (once its unfinished requests are done); False when it is not loaded."""
        return self._lora_manager().remove(lora_int_id)

    def check_lora(self, lora_path: str) -> AdapterSpec:
        """Vet an adapter folder against this engine's model and ``max_lora_rank`` as a load reads it (NaN weights
        are found before registration), without putting it in a slot; ``LoRAError`` (one line) says why not."""
        return load_adapter(lora_path, self.loaded.hf_config, max_lora_rank=self._lora_manager().max_lora_rank).spec

    def list_loras(self) -> list[LoRARequest]:
        """Adapters loaded on this engine (CPU pool or device slots); empty without ``enable_lora``."""
        return self.lora.loaded() if self.lora is not None else []

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise ValueError("LoRA adapters need an engine built with enable_lora=True")
        return self.lora

    # ------------------------------------------------------------------ admission
    def admit(self, request: EngineRequest) -> EngineRequest:
        """Check and tokenize a request without touching engine state (safe from any thread)."""
        return self.validator.admit(request)

    def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        tenant: str = "default",
        deadline: float | None = None,
        pooling: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request given as a front end's keyword arguments (for callers that drive ``step`` themselves);
        returns its id. ``priority`` is the scheduling tier, lower runs first; ``deadline`` as on ``EngineRequest``;
        ``pooling`` makes it an embedding; ``lora_request`` decodes it with that adapter."""
        request = EngineRequest.build(
            prompt, params, request_id=request_id, priority=priority, tenant=tenant, deadline=deadline,
            pooling=pooling, lora_request=lora_request,
        )  # fmt: skip
        return self.submit(request)

    def submit(self, request: EngineRequest) -> str:
        """Queue a request (admitting it first unless a front end already did); returns its id.

        Raises ``ValueError`` for a request that can never run or whose id is already in the engine.
        """
        if not request.is_admitted:
            request = self.validator.admit(request)
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if request.lora_request is not None:
            self._lora_manager().add(request.lora_request)  # loaded on demand; LoRAError refuses the request
        seq = self.sequences.make(request)
        seq.num_pending_forks = request.params.n - 1
        self._requests[seq.request_id] = [seq]
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> list[RequestDelta]:
        """Stop a waiting or running request (every unfinished choice) and free its blocks; returns one final
        delta per choice stopped (none when the id is unknown or already finished)."""
        seqs = self._requests.pop(request_id, [])
        now = time.time()
        deltas = []
        for seq in seqs:
            self._finish(seq, RequestStatus.FINISHED_ABORTED)
            seq.finish_time = now
            deltas.append(make_delta(seq))
        if seqs and seqs[0].num_pending_forks:
            # Siblings not forked yet finish too, so the request's stream sees all n choices end.
            deltas += [make_delta(self._aborted_sibling(seqs[0], i)) for i in range(1, 1 + seqs[0].num_pending_forks)]
        return deltas

    def _finish(self, seq: Sequence, status: RequestStatus) -> None:
        self.scheduler.finish(seq, status)
        if self.speculator is not None:
            self.speculator.forget(seq)

    def _aborted_sibling(self, parent: Sequence, index: int) -> Sequence:
        sibling = self.sequences.sibling(parent, index)
        sibling.status = RequestStatus.FINISHED_ABORTED
        sibling.finish_time = parent.finish_time
        return sibling

    def abort_request(self, request_id: str) -> RequestDelta | None:
        """``abort`` for a one-choice request: its final delta, or None when unknown or finished."""
        deltas = self.abort(request_id)
        return deltas[0] if deltas else None

    def abort_all(self) -> list[RequestDelta]:
        """Abort every unfinished request (shutdown); returns their final deltas."""
        return [d for rid in list(self._requests) for d in self.abort(rid)]

    def close(self) -> None:
        """Stop the offload writer and the other tensor-parallel ranks; the engine cannot step after."""
        if self.offloader is not None:
            self.offloader.close()
        if self.tp_ranks is not None:
            self.tp_ranks.stop()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def score(self, prompt: PromptInput, prefill_len: int | None = None, step_len: int = 1) -> torch.Tensor:
        """Float32 logits ``[num_tokens, vocab]`` of every position of ``prompt`` (row ``i`` predicts token
        ``i + 1``): teacher forcing through the engine's own model, attention backend and KV cache dtype.

        The first ``prefill_len`` tokens (default: all) run as one prefill step, the rest ``step_len`` tokens a
        step (1: decode steps; more: chunked prefill, far faster on a CPU), each reading its whole context back
        from the cache, as generated tokens do: with an FP8 cache every position past the prefill attends
        quantized K/V. At most ``max_model_len - 1`` tokens. Needs an idle
        engine (no unfinished requests); the blocks it borrows are returned before it does, unregistered in
        the prefix cache. Not for tensor-parallel engines or speculative drafts (the draft model is unused).
        """
        if self.has_unfinished():
            raise RuntimeError("score needs an idle engine: requests are still running")
        if self.tp_ranks is not None:
            raise RuntimeError("score does not run on a tensor-parallel engine")
        request = self.admit(EngineRequest.build(prompt, SamplingParams(max_tokens=1)))
        seq = self.sequences.make(request)
        n = seq.num_tokens
        if not self.block_manager.allocate(seq, [], n):
            raise RuntimeError(f"the KV cache has no room for {n} tokens")
        try:
            groups = [view.block_ids for view in seq.kv_group_views]
            return self.runner.score(
                seq.token_ids, seq.block_ids, n if prefill_len is None else prefill_len, step_len, groups
            )
        finally:
            self.block_manager.free(seq)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestDelta]:
        """Run one engine iteration; returns a delta for every request that produced a token (with
        ``stream_interval_ms``, for those whose interval is up, see :func:`.core.deltas.delta_due`)."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.sampler)
        batch = self.scheduler.schedule()
        if batch.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress although requests are pending")
            return []
        self.num_steps += 1
        now = time.time()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        sample_seqs, logits = self.runner.execute(batch)
        now = time.time()
        outputs: list[RequestDelta] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            # Drafts count as computed only once accepted (Speculator.accept).
            seq.num_computed_tokens += n - len(seq.spec_token_ids)
            self.block_manager.cache_computed_blocks(seq)
            if seq.embedding is not None:  # an embedding request whose prompt is now pooled: it is done
                seq.first_token_time = now
                self._retire(seq, RequestStatus.FINISHED_STOPPED, now)
                outputs.append(make_delta(seq))
        if logits is None:
            return outputs
        if any(seq.spec_token_ids for seq in sample_seqs):
            assert self.speculator is not None
            now = time.time()
            sample_seqs, logits, served = self.speculator.accept(
                self.sampler, sample_seqs, logits, lambda s, t: self._append_token(s, t, now), self.block_manager
            )
            outputs += [make_delta(seq) for seq in served if delta_due(seq, now, self._stream_interval_s)]
            if not sample_seqs:
                return outputs
        if any(seq.num_pending_forks for seq in sample_seqs):
            sample_seqs, logits = self._fork_choices(sample_seqs, logits)
        token_mask = None
        if any(seq.guided is not None for seq in sample_seqs):
            from .guided.matcher import grammar_bitmask

            token_mask = grammar_bitmask([seq.guided for seq in sample_seqs], logits.shape[1])
        sampled = self.sampler(logits, sample_seqs, token_mask)
        now = time.time()
        for i, (seq, token) in enumerate(zip(sample_seqs, sampled.tokens, strict=True)):
            if sampled.logprobs is not None and seq.logprobs is not None:
                logprob = sampled.logprobs[i]
                assert logprob is not None
                seq.logprobs.append(logprob)
            self._append_token(seq, token, now)
            if delta_due(seq, now, self._stream_interval_s):
                outputs.append(make_delta(seq))
        return outputs

    def _fork_choices(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
        """Fork the siblings of every first choice whose prompt is now computed; they sample from its row."""
        rows = list(range(len(seqs)))
        seqs = list(seqs)
        for row in range(len(rows)):
            parent = seqs[row]
            if parent.num_pending_forks:
                forked, queued = fork_choices(
                    parent, self.sequences.sibling, self.block_manager, self.scheduler, self.runner.copy_block
                )
                self._requests[parent.request_id] += forked + queued
                seqs += forked
                rows += [row] * len(forked)
        return seqs, logits[torch.tensor(rows, device=logits.device)]

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        delta = seq.detokenizer.step(token)
        seq.text += delta
        status = check_stop(seq, token, delta)
        if seq.guided is not None and status is None:
            # The grammar ends the output once complete; a refused token (nothing was allowed) ends it too.
            if not seq.guided.accept(token) or seq.guided.is_terminated:
                status = RequestStatus.FINISHED_STOPPED
        if status is None and (seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            if seq.stop_reason is None or isinstance(seq.stop_reason, int):
                # Not cut at a stop string: the text is everything the tokens decode to.
                seq.text += seq.detokenizer.flush()
            self._retire(seq, status, now)

    def _retire(self, seq: Sequence, status: RequestStatus, now: float) -> None:
        """Finish a sequence that ran to its end (blocks freed) and drop it from its request's live choices."""
        self._finish(seq, status)
        seq.finish_time = now
        live = self._requests[seq.request_id]
        live.remove(seq)
        if not live:
            del self._requests[seq.request_id]

    # ------------------------------------------------------------------ introspection
    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def take_kv_events(self) -> KVCacheEvents | None:
        """The prefix cache's and the offload tiers' changes since the last call (None when none, or events off)."""
        return kv_journal.take_events(self.block_manager, self.offloader)

    def kv_snapshot(self) -> KVCacheEvents:
        """Every block the prefix cache and the local tiers hold now; the events that follow continue from it."""
        return kv_journal.snapshot(self.block_manager, self.offloader)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        running, waiting = self.scheduler.counts_by_priority()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            prefix_cache_hit_rate=bm.prefix_hit_rate,
            prefix_cache_queries=bm.prefix_query_tokens,
            prefix_cache_hits=bm.prefix_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            running_by_priority=running,
            waiting_by_priority=waiting,
            spec_num_drafts=self.speculator.num_drafts if self.speculator else 0,
            spec_num_draft_tokens=self.speculator.num_draft_tokens if self.speculator else 0,
            spec_num_accepted_tokens=self.speculator.num_accepted_tokens if self.speculator else 0,
            kv_offload=self.offloader.stats_snapshot() if self.offloader is not None else None,
        )
