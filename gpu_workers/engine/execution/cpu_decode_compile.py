"""Decode steps on the CPU as one compiled graph: the decoder's small operations fused, no Python between them.

On a CPU the decode step of a small model is dominated by dispatch, not arithmetic: some 40 small operations a
layer (norms, residual adds, rotary, casts, the KV store, activation and gating) around the projections, each a
trip through Python and the dispatcher (docs/benchmarks.md, "Where a CPU decode step goes"). Compiling the whole
forward with ``torch.compile`` (Inductor) fuses those into a few C++ loops a layer and, with its C++ wrapper, calls
them without Python; the projections' kernels (torch's int4 / int8 / dense matmuls) are called as they are.

What makes one graph possible is attention: the torch backend plans each step on the host, which would break the
graph at every layer, so a compiled step's metadata says ``compiled_decode`` and the backend attends in tensor
operations alone (``attention/gathered_decode.py``). Decode steps go through the graph, and so do short
prompt-taking steps (prefill chunks, mixed steps; ``takes``), every token a row over its own context as the
deterministic mode runs them (below): the 40-odd small operations a layer cost such a step as much as its products
(a chat prompt's prefill 4-9 ms faster on two cores, docs/benchmarks.md). Longer ones, and anything this module
refuses (``unsupported``), run eagerly.

Shapes: a decode step of one row is compiled on its own (Inductor specializes size 1, and it attends with
``gathered_decode``); every other step the graph takes runs as token rows through one graph of 2 to ``MAX_ROWS`` rows,
the row count and the block-table width dynamic, whose attention also reads the keys the step itself computes
(``attention/gathered_invariant.py``; a lone prompt token gets a throwaway companion row). Decode batches gain by it
too: at 1,000 tokens of context a batch of 8 stepped in 79-84 ms against 104-106 through ``gathered_decode``. So a
server compiles twice, at start (``warm_up``), and Inductor's on-disk cache makes a restart cheap. Inductor writes the
thread count into its kernels: both graphs are built for the engine's own count, the decode steps'; prompt-taking
steps on more threads (``cpu_prefill_threads``) get them in the projections' kernels, which read torch's count when
they run.

Under the deterministic mode (``invariant``) every step runs through the graph, prompt tokens as rows of their own
(``invariant_rows.py``), attended alone over their own contexts (``attention/gathered_invariant.py``), so a token's
numbers are those of one compiled arithmetic whatever the step holds. That mode compiles only the many-row graph (a
lone row gets a throwaway companion): a second graph would be a second arithmetic.

The C++ compiler Inductor calls (``g++`` unless ``CXX`` says otherwise) must be installed; without it, or if
compiling fails, the engine logs why and stays eager.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..attention.metadata import AttentionMetadata
from .invariant_rows import token_rows, with_companion

if TYPE_CHECKING:
    from ..config import EngineConfig

logger = logging.getLogger(__name__)

# The largest decode batch run through the graph; larger ones run eagerly (where the projections' kernels change
# with the row count: quantization/cpu_linear.py's DENSE_MIN_ROWS).
MAX_ROWS = 64
# Prompt-taking steps the graph takes: at most this many tokens, over contexts at most this long. Each row gathers its
# whole context, so the rows' attention reads tokens x context keys where the eager path's flash attention reads the
# context once: past these, eager is cheaper.
ROWS_MAX_TOKENS = MAX_ROWS
ROWS_MAX_CONTEXT = 256
# The deterministic mode's longest block table: its attention sums a context block by block, and the compiler cuts a
# float sum longer than 4096 its own way (gathered_invariant.py). 4096 blocks of 16: 65,536 tokens.
MAX_INVARIANT_BLOCKS = 4096
# Inductor's C++ wrapper calls the fused kernels from C++ rather than from generated Python (1.4 ms of a 17 ms
# step on one thread). Built apart from the kernels, the wrapper (one long function for all the layers) compiles
# at a lower optimization level: 29 s instead of 117 s of a cold start on two cores, the step no slower.
INDUCTOR_OPTIONS: dict[str, object] = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}


def cxx_compiler() -> str | None:
    """The C++ compiler Inductor will call, if it is installed."""
    return shutil.which(os.environ.get("CXX") or "g++")


class DecodeBatch(Protocol):
    """A prepared pure-decode batch (the model runner's ``PreparedBatch``)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


@dataclass(frozen=True)
class DecodeTarget:
    """What the compiled path needs of a model runner, which owns the model, its cache and how batches are built."""

    model: torch.nn.Module
    # ``[2, layers, blocks, block_size, kv_heads, head_dim]``.
    kv_cache: torch.Tensor
    device: torch.device
    backend_name: str
    block_size: int
    # A sliding-window layer or a hybrid (per layer group) cache; an FP8 cache; LoRA adapters.
    sliding: bool
    fp8_cache: bool
    lora: bool
    # The longest block table a sequence can have (max_model_len over the block size, rounded up).
    max_blocks: int
    # The runner's batch builder: (input ids, positions, slots, query starts, sequence lengths, block tables,
    # logits rows, sampling sequences, max query length) -> a batch.
    build: Callable[..., DecodeBatch]


def unsupported(target: DecodeTarget, config: EngineConfig) -> str | None:
    """Why decode steps cannot run compiled here, or None when they can."""
    if not config.compile_cpu_decode:
        return "compile_cpu_decode is off"
    if target.device.type != "cpu":
        return f"device {target.device} is not the CPU"
    if target.backend_name != "torch":
        return f"the {target.backend_name!r} attention backend has no compiled decode path"
    if config.deterministic and target.max_blocks > MAX_INVARIANT_BLOCKS:
        return f"the deterministic mode compiles contexts up to {MAX_INVARIANT_BLOCKS} blocks, not {target.max_blocks}"
    if target.sliding:
        return "sliding-window layers attend with the eager planner"
    if target.fp8_cache:
        return "an FP8 KV cache is widened by the eager planner"
    if target.lora:
        return "LoRA adapters are applied eagerly"
    if config.tensor_parallel_size > 1:
        return "tensor-parallel ranks exchange activations between the pieces"
    if config.speculative_config is not None:
        return "speculative decoding verifies drafts in mixed steps"
    if cxx_compiler() is None:
        return "no C++ compiler for Inductor (install g++ or set CXX)"
    return None


def _own_code(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a code object of its own. Dynamo keeps its compiled graphs on the code object, and with the
    guards on modules skipped, a second engine in the process (its own model and cache, the same ``step`` source)
    would be handed the first engine's graph: a shape error at best, the other engine's weights and cache at worst."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _mark(tensor: torch.Tensor, dim: int, min_size: int, max_size: int | None = None) -> None:
    torch._dynamo.mark_dynamic(tensor, dim, min=min_size, max=max_size)


class CompiledCpuDecode:
    """The model's forward compiled for decode steps of 1 to ``MAX_ROWS`` rows over ``kv_cache`` (the runner's
    ``[2, layers, blocks, block_size, kv_heads, head_dim]`` tensor); call ``warm_up`` once, then ``run`` with
    prepared decode batches (``fits`` says which)."""

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, invariant: bool = False) -> None:
        self.invariant = invariant
        layers, _, _, heads, head_dim = kv_cache.shape[1:]
        # K and V as ``[layers, slots, kv_heads, head_dim]`` views of the cache: where a step's new rows go.
        self._k_slots, self._v_slots = kv_cache.view(2, layers, -1, heads, head_dim).unbind(0)

        def step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
            hidden = model(input_ids, positions, meta)
            new_kv = meta.new_kv or []
            # Stacked inside the graph: the caller stores every layer's new K (and V) with one indexed copy.
            return hidden, torch.stack([k for k, _ in new_kv]), torch.stack([v for _, v in new_kv])

        # Guards on the model's modules are skipped: its weights never change shape while the engine lives, and
        # checking every module and parameter of every layer on each call costs more than the fused ops save.
        options = {**INDUCTOR_OPTIONS, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        if invariant:
            # Fused, Inductor keeps a bfloat16 value in float32 from the op that makes it to the op that uses it:
            # a prompt token's fresh key (used in the step that computes it) would then carry bits that the same
            # key read back from the bfloat16 cache by a later step does not. Rounding at every op as eager does
            # keeps one value per key.
            options["emulate_precision_casts"] = True
        self._step = torch.compile(_own_code(step), fullgraph=True, dynamic=False, options=options)

    def takes(self, prepared: DecodeBatch, decode_only: bool) -> bool:
        """Whether a prepared step runs through the graphs: every step in the deterministic mode; otherwise decode
        steps of up to ``MAX_ROWS`` rows, and prompt-taking steps within ``ROWS_MAX_TOKENS`` and
        ``ROWS_MAX_CONTEXT``."""
        tokens = prepared.input_ids.shape[0]
        if self.invariant:
            return True
        if decode_only:
            return 1 <= tokens <= MAX_ROWS
        return tokens <= ROWS_MAX_TOKENS and prepared.meta.max_seq_len <= ROWS_MAX_CONTEXT

    def forward(self, prepared: DecodeBatch, decode_only: bool) -> torch.Tensor:
        """Hidden states of a step ``takes`` accepted: a lone decode row through its own graph, the rest as rows."""
        if decode_only and prepared.input_ids.shape[0] == 1 and not self.invariant:
            return self.run(prepared)
        return self.run_step(prepared.input_ids, prepared.positions, prepared.meta)

    def run_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of any step (prefill, mixed or decode), every token a row."""
        hidden = [self.run(rows) for rows in token_rows(input_ids, positions, meta, MAX_ROWS)]
        return hidden[0] if len(hidden) == 1 else torch.cat(hidden)

    def run(self, prepared: DecodeBatch) -> torch.Tensor:
        """Hidden states of a prepared decode batch or batch of token rows (with ``fresh_from``; its metadata is
        marked for the compiled path); the step's new K/V are in the cache when it returns."""
        rows = prepared.input_ids.shape[0]
        as_rows = prepared.meta.fresh_from is not None  # token rows (the rows' graph), not a decode batch
        if as_rows and rows == 1:
            prepared = with_companion(prepared.input_ids, prepared.positions, prepared.meta)
        meta = prepared.meta
        tables = meta.block_tables
        if tables.shape[1] < 2:
            # A table one block wide would be specialized (Inductor treats sizes 0 and 1 apart): pad it with a
            # block the mask hides, so every width shares the graph.
            tables = torch.nn.functional.pad(tables, (0, 1))
        meta.block_tables = tables
        meta.compiled_decode = True
        meta.new_kv = []
        _mark(tables, 1, 2, MAX_INVARIANT_BLOCKS if as_rows else None)
        if prepared.input_ids.shape[0] > 1:
            marked = [prepared.input_ids, prepared.positions, meta.slot_mapping, meta.seq_lens, tables]
            for tensor in marked if meta.fresh_from is None else [*marked, meta.fresh_from]:
                _mark(tensor, 0, 2, MAX_ROWS)
        with torch.inference_mode():
            hidden, keys, values = self._step(prepared.input_ids, prepared.positions, meta)
            slots = meta.slot_mapping[:rows]
            self._k_slots.index_copy_(1, slots, keys[:, :rows])
            self._v_slots.index_copy_(1, slots, values[:, :rows])
        return hidden[:rows]

    def warm_up(self, target: DecodeTarget) -> None:
        """Compile the graphs now (the one-row decode graph and the rows graph; the deterministic mode's rows graph
        alone), with steps over block 0 (free at start: a sequence writes its slots before it reads them), so no
        request waits for the compiler."""
        started = time.perf_counter()
        bs = target.block_size
        # (rows, as token rows): as rows, every row's key is fresh from its own position.
        variants = [(2, True)] if self.invariant else [(1, False), (2, True)]
        for rows, as_rows in variants:
            positions = [bs + 1] * rows
            prepared = target.build(
                [0] * rows, positions, list(range(rows)), list(range(rows + 1)), [p + 1 for p in positions],
                [[0, 0]] * rows, list(range(rows)), [], 1,
            )  # fmt: skip
            if as_rows:
                prepared.meta.fresh_from = prepared.positions.clone()
            self.run(prepared)
        seconds = time.perf_counter() - started
        shapes = (
            f"every step as rows, 2-{MAX_ROWS} a call"
            if self.invariant
            else f"a lone decode row; 2-{MAX_ROWS} decode rows, or prompt steps up to {ROWS_MAX_TOKENS} tokens, as rows"
        )
        logger.info("decode steps compiled for the CPU in %.1f s (%s)", seconds, shapes)


def compiled_decode_for(target: DecodeTarget, config: EngineConfig) -> CompiledCpuDecode | None:
    """A warmed-up compiled decode for this runner, or None (the reason logged) when it cannot have one."""
    reason = unsupported(target, config)
    if reason is not None:
        if config.compile_cpu_decode:
            logger.info("compiled CPU decode off: %s", reason)
        return None
    compiled = CompiledCpuDecode(target.model, target.kv_cache, invariant=config.deterministic)
    try:
        compiled.warm_up(target)
    except Exception as exc:  # any compiler failure leaves the eager path, which always works
        logger.warning("compiled CPU decode off: compiling failed (%s: %s)", type(exc).__name__, exc)
        return None
    return compiled
