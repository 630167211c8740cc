"""Owns the paged KV cache and runs a scheduled batch's forward pass: eager, a CUDA graph or a compiled CPU graph.

A step's inputs are built by ``step_inputs.py`` (``StepInputs``, which the runner extends); decode rows gathered
there are shared by the eager path and the CUDA-graph path (``cuda_graphs.py``), which copies them into padded static
buffers and replays a captured forward.

The cache is in the model's dtype, or float8_e4m3fn (``kv_cache_dtype="fp8"``) with per-layer,
per-KV-head scales (``attention/kv_quant.py``) that every layer's attention reads; scales the
checkpoint does not give are computed on the cache's first step (run eagerly), then fixed.

With LoRA adapters (``lora/``) each step's ``LoRABatch`` (a slot per token, from ``PreparedBatch.runs``) is set
on the model's ``LoRAContext`` around the forward. Decode CUDA graphs have a LoRA variant per bucket: a decode
batch in which some sequence uses an adapter replays it with each row's slot written into a static buffer.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from ..attention.base import AttentionBackend
from ..attention.kv_quant import KVScales
from ..attention.metadata import AttentionMetadata
from ..config import EngineConfig
from ..core.kv_groups import KVGroupLayout
from ..core.scheduler import ScheduledBatch
from ..core.sequence import Sequence
from ..models.loader import LoadedModel
from .cpu_decode_compile import CompiledCpuDecode, DecodeTarget, compiled_decode_for
from .cpu_step_threads import CpuStepThreads
from .cuda_graphs import DecodeGraphRunner, graph_batch_sizes
from .kv_group_cache import allocate_group_caches
from .pooler import pool
from .step_inputs import CASCADE_MIN_PREFIX_LEN, CASCADE_MIN_SEQS, CommonPrefixFn, StepInputs

if TYPE_CHECKING:
    from ..lora.manager import LoRAManager

logger = logging.getLogger(__name__)


def kv_bytes_per_block(loaded: LoadedModel, block_size: int, cache_dtype: torch.dtype | None = None) -> int:
    """Bytes one block takes across all layers, K and V, in ``cache_dtype`` (default: the model's)."""
    elem = (cache_dtype or loaded.dtype).itemsize
    return 2 * loaded.num_layers * block_size * loaded.num_kv_heads * loaded.head_dim * elem


class ModelRunner(StepInputs):
    def __init__(
        self,
        loaded: LoadedModel,
        backend: AttentionBackend,
        block_size: int,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.backend = backend
        self.block_size = block_size
        self.device = next(self.model.parameters()).device
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = 0
        # float8_e4m3fn for an FP8 cache (then kv_scales exists once the cache does), else the model's dtype.
        self.kv_cache_dtype = kv_cache_dtype or loaded.dtype
        self.kv_scales: KVScales | None = None
        for layer in self.model.attention_layers:
            layer.backend = backend
        # Set by setup_decode once the KV cache exists.
        self.use_cascade = False
        self.cascade_min_prefix_len = CASCADE_MIN_PREFIX_LEN
        self.cascade_min_seqs = CASCADE_MIN_SEQS
        self._common_prefix_len: CommonPrefixFn | None = None
        self.decode_graphs: DecodeGraphRunner | None = None
        # On the CPU: pure decode steps as one compiled graph (cpu_decode_compile.py), set by setup_decode.
        self.compiled_decode: CompiledCpuDecode | None = None
        # With cpu_prefill_threads: prompt-taking CPU steps on more threads than decode steps (set by setup_decode).
        self.step_threads: CpuStepThreads | None = None
        # The engine's adapters when LoRA is enabled (set by LLMEngine).
        self.lora: LoRAManager | None = None
        # Set by allocate_hybrid_kv_cache: the layer groups, and every group's cache (group 0's is kv_cache).
        self.kv_layout: KVGroupLayout | None = None
        self.group_kv_caches: list[torch.Tensor] = []

    # ------------------------------------------------------------------ decode options
    def setup_decode(self, config: EngineConfig, max_model_len: int) -> None:
        """Turn on the decode-step features this backend and device allow: cascade attention over
        shared prefixes (``enable_cascade_attention``, backends with a cascade path) and CUDA
        graphs (CUDA only, unless ``enforce_eager``). Call after ``allocate_kv_cache``."""
        if self.kv_cache is None:
            raise RuntimeError("allocate the KV cache before setting up decode (graphs bind its addresses)")
        # The shared-prefix pass attends the whole prefix: no use to a sliding layer, and released blocks
        # (-1 in every table) would look shared.
        sliding = any(w is not None for w in self.loaded.sliding_windows)
        self.use_cascade = (
            config.enable_cascade_attention and bool(getattr(self.backend, "supports_cascade", False)) and not sliding
        )
        if self.use_cascade:
            from ..attention.triton_kernels import common_prefix_len

            self._common_prefix_len = common_prefix_len
        if self.device.type == "cpu":
            target = self._decode_target(self.kv_cache, sliding, max_model_len)
            self.compiled_decode = compiled_decode_for(target, config)
        # The deterministic mode holds one thread count: a kernel may split its sums by thread, and a prompt token
        # must be computed as its decode step would be.
        prefill_threads = 0 if config.deterministic else config.cpu_prefill_threads
        self.step_threads = CpuStepThreads.from_config(prefill_threads, self.device)
        reason = self.decode_graphs_unsupported(config)
        if reason is not None:
            logger.info("decode CUDA graphs off: %s", reason)
            return
        self.enable_decode_graphs(config.max_num_seqs, max_model_len)

    def _decode_target(self, kv_cache: torch.Tensor, sliding: bool, max_model_len: int) -> DecodeTarget:
        """This runner, with its allocated cache, as the compiled CPU decode sees it."""
        return DecodeTarget(
            model=self.model,
            kv_cache=kv_cache,
            device=self.device,
            backend_name=self.backend.name,
            block_size=self.block_size,
            sliding=sliding or self.kv_layout is not None,
            fp8_cache=self.kv_cache_dtype != self.loaded.dtype,
            lora=self.lora is not None,
            max_blocks=-(-max_model_len // self.block_size),
            build=self._build,
        )

    def decode_graphs_unsupported(self, config: EngineConfig) -> str | None:
        """Why decode steps cannot use CUDA graphs here, or None when they can."""
        if config.enforce_eager:
            return "enforce_eager=True"
        if self.device.type != "cuda":
            return f"device {self.device} is not a CUDA device"
        if not getattr(self.backend, "cuda_graph_safe", False):
            return f"the {self.backend.name!r} attention backend syncs with the host"
        if (config.quantization or "").startswith("bnb-"):
            return "bitsandbytes layers inspect activations on the host"
        if self.kv_layout is not None:
            return "the hybrid KV cache's per-group block tables have no static graph buffers"
        return None

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int, *, capture: bool = True) -> None:
        """Route decode-only batches of up to ``max_num_seqs`` rows through padded static buffers,
        captured as CUDA graphs per bucket (``capture=False`` runs that padded path eagerly)."""
        graphs = DecodeGraphRunner(
            self.model,
            graph_batch_sizes(max_num_seqs),
            max_model_len,
            self.block_size,
            self.device,
            cascade=self.use_cascade,
            capture=capture,
            lora=self.lora.context if self.lora is not None else None,
        )
        graphs.capture()
        self.decode_graphs = graphs

    # ------------------------------------------------------------------ KV cache
    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One ``[2, layers, blocks, block_size, kv_heads, head_dim]`` tensor, viewed per layer.

        Zero-filled: padded block-table entries and partly filled blocks are read (then masked), and
        masked garbage could be NaN, which a zero attention weight does not cancel.
        """
        lm = self.loaded
        self.kv_cache = torch.zeros(
            2, lm.num_layers, num_blocks, self.block_size, lm.num_kv_heads, lm.head_dim,
            dtype=self.kv_cache_dtype, device=self.device,
        )  # fmt: skip
        self.num_blocks = num_blocks
        self.kv_layout = None
        self.group_kv_caches = []
        self._bind_layers([(0, i) for i in range(lm.num_layers)], [self.kv_cache])

    def allocate_hybrid_kv_cache(self, layout: KVGroupLayout, group_blocks: tuple[int, ...]) -> None:
        """One cache per layer group (``core/kv_groups.py``), each ``[2, group layers, its blocks, ...]``."""
        lm = self.loaded
        caches, places = allocate_group_caches(
            layout, group_blocks, self.block_size, lm.num_kv_heads, lm.head_dim, self.kv_cache_dtype, self.device
        )
        self.kv_cache, self.group_kv_caches, self.kv_layout = caches[0], caches, layout
        self.num_blocks = group_blocks[0]
        self._bind_layers(places, caches)

    def _bind_layers(self, places: list[tuple[int, int]], caches: list[torch.Tensor]) -> None:
        """Point attention layer ``i`` at ``caches[group][:, index]`` for ``places[i] = (group, index)``."""
        lm = self.loaded
        if self.kv_cache_dtype.itemsize == 1:
            self.kv_scales = KVScales(lm.num_layers, lm.num_kv_heads, self.device, lm.kv_scales)
        for i, layer in enumerate(self.model.attention_layers):
            group, index = places[i]
            layer.kv_group = group
            layer.k_cache = caches[group][0, index]
            layer.v_cache = caches[group][1, index]
            if self.kv_scales is not None:
                layer.k_scale, layer.v_scale = self.kv_scales.layer(i)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one KV block's keys and values in every layer (copy-on-write of a forked partial block)."""
        assert self.kv_cache is not None
        if self.kv_layout is not None:
            raise RuntimeError("a hybrid KV cache does not fork blocks (see core/kv_groups.py)")
        self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])

    def profile_num_blocks(self, config: EngineConfig, max_model_len: int, extra_bytes_per_block: int = 0) -> int:
        """How many KV blocks fit: a share of free GPU memory after a full-budget forward, or the
        configured CPU share (never more than ``max_num_seqs`` full-length sequences need).
        ``extra_bytes_per_block``: what each block costs elsewhere too (a draft model's cache block)."""
        per_block = kv_bytes_per_block(self.loaded, self.block_size, self.kv_cache_dtype) + extra_bytes_per_block
        max_useful = config.max_num_seqs * -(-max_model_len // self.block_size)
        if self.device.type != "cuda":
            return max(1, min(int(config.cpu_kv_cache_gb * (1 << 30)) // per_block, max_useful))
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._profile_forward(min(config.max_num_batched_tokens, config.max_num_seqs * max_model_len), max_model_len)
        torch.cuda.synchronize(self.device)
        activation_peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_elsewhere = total - free
        budget = int(total * config.gpu_memory_utilization) - used_elsewhere - activation_peak
        return max(0, min(budget // per_block, max_useful))

    def _profile_forward(self, num_tokens: int, max_model_len: int) -> None:
        """A throw-away forward of ``num_tokens`` fresh prefill tokens against a one-block cache
        (every slot is -1, so nothing is stored) to measure peak activation memory."""
        self.allocate_kv_cache(1)
        lens = []
        remaining = num_tokens
        while remaining > 0:
            lens.append(min(remaining, max_model_len))
            remaining -= lens[-1]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            # All rows point at block 0: wide enough that no backend indexes past the table.
            block_tables=torch.zeros((len(lens), -(-max(lens) // self.block_size)), dtype=torch.int32, device=dev),
            max_query_len=max(lens),
            max_seq_len=max(lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=lens,
        )
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, meta)
            self.model.compute_logits(hidden[torch.tensor([s - 1 for s in starts[1:]], device=dev)])
        self.kv_cache = None
        self.kv_scales = None
        for layer in self.model.attention_layers:
            layer.k_cache = layer.v_cache = layer.k_scale = layer.v_scale = None

    # ------------------------------------------------------------------ forward
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor | None]:
        """Run one step; return the sequences that sample and their float32 logits (or None): one row per
        sequence, ``1 + len(seq.spec_token_ids)`` consecutive rows for a sequence verifying drafts. Embedding
        requests never sample: their rows are pooled (``pooler.py``), which sets ``seq.embedding`` once the
        prompt is computed."""
        if self.kv_cache is None:
            raise RuntimeError("KV cache not allocated")
        graphs = self.decode_graphs
        # An FP8 cache without given scales computes them on its first step, eagerly (never in a graph).
        calibrate = self.kv_scales is not None and not self.kv_scales.fixed
        decode_only = all(n == 1 for n in batch.num_new_tokens) and not any(s.pooling for s in batch.seqs)
        fits = graphs is not None and len(batch.seqs) <= graphs.max_batch
        if graphs is not None and fits and not calibrate and decode_only:
            return self._execute_decode_graph(graphs, batch.seqs)
        if self.step_threads is not None:
            self.step_threads.enter(decode_only)
        prepared = self.prepare(batch)
        prepared.meta.calibrate_kv_scales = calibrate
        lora = self.lora
        step_lora = lora.context.active(lora.batch_for(prepared.runs)) if lora is not None else nullcontext()
        compiled = self.compiled_decode
        with torch.inference_mode(), step_lora:
            if compiled is not None and not calibrate and compiled.takes(prepared, decode_only):
                hidden = compiled.forward(prepared, decode_only)
            else:
                hidden = self.model(prepared.input_ids, prepared.positions, prepared.meta)
            if calibrate and self.kv_scales is not None:
                self.kv_scales.fixed = True
                logger.info("FP8 KV cache scales set from the first step's %d tokens", prepared.input_ids.shape[0])
            if prepared.pool_spans:
                pool(hidden, prepared.pool_spans)
            if not prepared.sample_seqs:
                return [], None
            logits = self.model.compute_logits(hidden[prepared.logits_indices])
        return prepared.sample_seqs, logits.float()

    def score(
        self,
        token_ids: list[int],
        block_ids: list[int],
        prefill_len: int,
        step_len: int = 1,
        group_block_ids: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """Float32 logits ``[len(token_ids), vocab]`` of every position (row ``i`` predicts token ``i + 1``),
        computed as the engine computes a request: the first ``prefill_len`` tokens as one prefill step, then
        the rest ``step_len`` tokens a step (1: decode steps; more: chunked prefill), each step reading all K/V
        of its context, its own tokens' included, back from the cache (an FP8 cache has quantized them, so
        every position past the prefill sees what a generated token sees). ``block_ids`` must hold
        ``len(token_ids)`` slots and belong to no other sequence (as must ``group_block_ids``, a hybrid cache's
        tables of the groups past the first). Eager only (no CUDA graphs); an FP8 cache
        without fixed scales calibrates them on the prefill."""
        if self.kv_cache is None:
            raise RuntimeError("KV cache not allocated")
        n = len(token_ids)
        if not 1 <= prefill_len <= n:
            raise ValueError(f"prefill_len must be in [1, {n}], got {prefill_len}")
        if step_len < 1:
            raise ValueError(f"step_len must be at least 1, got {step_len}")
        if len(block_ids) * self.block_size < n:
            raise ValueError(f"{len(block_ids)} blocks cannot hold {n} tokens")
        bs = self.block_size
        rows: list[torch.Tensor] = []
        ends = [prefill_len, *range(prefill_len + step_len, n, step_len)]
        if ends[-1] != n:
            ends.append(n)
        start = 0
        with torch.inference_mode():
            for end in ends:
                positions = list(range(start, end))
                prepared = self._build(
                    token_ids[start:end],
                    positions,
                    [block_ids[p // bs] * bs + p % bs for p in positions],
                    [0, end - start],
                    [end],
                    [block_ids],
                    list(range(end - start)),
                    [],
                    end - start,
                    group_tables=[[t] for t in group_block_ids] if group_block_ids else None,
                )
                calibrate = self.kv_scales is not None and not self.kv_scales.fixed
                prepared.meta.calibrate_kv_scales = calibrate
                hidden = self.model(prepared.input_ids, prepared.positions, prepared.meta)
                if calibrate and self.kv_scales is not None:
                    self.kv_scales.fixed = True
                rows.append(self.model.compute_logits(hidden).float())
                start = end
        return torch.cat(rows)

    def _execute_decode_graph(
        self, graphs: DecodeGraphRunner, seqs: list[Sequence]
    ) -> tuple[list[Sequence], torch.Tensor | None]:
        rows = self._decode_rows(seqs)
        if self.lora is not None:
            rows.lora_slots = self.lora.row_slots(seqs)
        logits_rows = [i for i, seq in enumerate(seqs) if seq.num_computed_tokens + 1 == seq.num_tokens]
        hidden = graphs.run(rows)
        if not logits_rows:
            return [], None
        with torch.inference_mode():
            if len(logits_rows) < len(seqs):
                hidden = hidden[torch.tensor(logits_rows, dtype=torch.int64, device=self.device)]
            logits = self.model.compute_logits(hidden)
        return [seqs[i] for i in logits_rows], logits.float()
