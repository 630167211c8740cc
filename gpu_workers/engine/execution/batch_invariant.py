"""The deterministic mode: every token's numbers independent of the batch it is computed in.

A token's logits depend on how many other tokens share its step wherever a kernel's reduction order depends on the
batch. Measured on the CPU (``benchmarks/determinism_sources.py``, docs/benchmarks.md), the sources were:

- dense matmuls: a one-row product runs a GEMV whose sum order differs from the GEMM of two or more rows, and a
  float32 GEMM treats the rows of a partial tile (fewer than 16) differently from whole tiles;
- decode attention gathered into one batch padded to the longest context, so a row's softmax and ``P @ V``
  reduce over a length set by the other rows;
- a prompt's attention over its fresh keys (one causal call) against a decode's attention over the cache: a prefill
  of N tokens did not give the keys and logits of N decode steps, so chunk boundaries, prefix-cache hits and
  recompute after preemption changed the answer;
- the int4 kernel's switch to an unpacked float32 weight from 128 rows (a prefill) on AVX2.

Under the mode: dense linears never multiply fewer rows than their dtype's tile (padding with zero rows, which
cannot change a real row's sums), the int4 layers stay on their kernel (its per-row sums do not depend on the
number of rows: tested), and the torch attention backend attends every query token, prefill or decode, alone over
its own context read from the cache (``attention/per_token.py``), so a prefill token's numbers are those of a
decode step at its position. RMSNorm, rotary, the MLP's activations and sampling are per row already. Seeded
sampling's draws are keyed by position whatever the mode (``core/counter_rng.py``).

Where CPU steps are compiled (``compile_cpu_decode``), the mode runs every step, prompt tokens included, through the
one compiled graph instead (``cpu_decode_compile.py``, ``invariant_rows.py``, ``attention/gathered_invariant.py``):
same per-token attention, fused ops, one arithmetic for every token. Its numbers are not the eager mode's, so workers
that should answer alike also share that setting. The mode holds one thread count for every step (no
``cpu_prefill_threads``).

What stays fixed is a build's reduction order on one instruction set with one thread count: workers that should
answer alike run the same image on the same CPU family with the same ``SLUICEGATE_TORCH_THREADS``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..quantization.cpu_linear import CpuInt4Linear

if TYPE_CHECKING:
    from ..attention.base import AttentionBackend

# Fewest rows a dense CPU matmul is given under the mode, per dtype: from this many rows on, a row's result was the
# same whatever the number of rows and its place among them (tests/unit/engine/test_batch_invariant.py checks it on
# the machine the tests run on). bfloat16 / float16 (oneDNN) differ only for a single row (a GEMV).
_MIN_ROWS = {torch.float32: 16, torch.bfloat16: 2, torch.float16: 2}


def min_rows(dtype: torch.dtype) -> int:
    """Fewest rows a dense matmul in ``dtype`` is given under the mode."""
    return _MIN_ROWS.get(dtype, 16)


def invariant_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` with at least ``min_rows`` rows multiplied (zero rows padded, then dropped)."""
    flat = x.reshape(-1, layer.in_features)
    rows, least = flat.shape[0], min_rows(layer.weight.dtype)
    if torch.compiler.is_compiling():
        # A compiled step's row count is symbolic: a branch on it would split the graph (or break its declared
        # range), so the padding is always there. ``least`` more rows, never fewer than ``least`` in all.
        padded = F.pad(flat, (0, 0, 0, least))
    elif rows >= least:
        return F.linear(x, layer.weight, layer.bias)
    else:
        padded = flat.new_zeros(least, layer.in_features)
        padded[:rows] = flat
    out = F.linear(padded, layer.weight, layer.bias)[:rows]
    return out.reshape(*x.shape[:-1], layer.out_features)


def shadow_forward(module: nn.Module, forward: Callable[..., torch.Tensor]) -> None:
    """Run ``forward(module, x)`` for ``module(x)``: an instance attribute shadows the class's forward, so the
    module, its weights and their ties stay as they are."""
    module.forward = functools.partial(forward, module)  # type: ignore[method-assign]


def make_batch_invariant(model: nn.Module, backend: AttentionBackend) -> int:
    """Switch a loaded model and its attention backend to batch-invariant execution; returns how many dense
    linears now pad their rows. The backend must be the torch one (``EngineConfig`` refuses others)."""
    if not hasattr(backend, "batch_invariant"):
        raise ValueError(f"the {backend.name!r} attention backend has no batch-invariant path")
    backend.batch_invariant = True
    padded = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            shadow_forward(module, invariant_linear)
            padded += 1
        elif isinstance(module, CpuInt4Linear):
            module.batch_invariant = True
    return padded
