"""LoRA on the model's projections: each wrapped layer adds the step's adapters' ``scale * B @ A x`` to its base.

``LoRALinear`` wraps whatever module sits at ``qkv_proj``, ``o_proj``, ``gate_up_proj`` or ``down_proj`` (an
``nn.Linear`` or a quantized layer: int4, cpu-int8/int4, FP8, bitsandbytes); the base output is computed as before
and the LoRA delta is added to it, so quantization and LoRA never need to know of each other. A merged projection
has one slice per PEFT module (``q_proj``/``k_proj``/``v_proj`` in ``qkv_proj``), each with its own slot-stacked
A ``[max_loras, max_lora_rank, in]`` and B ``[max_loras, out, max_lora_rank]`` (ranks below the maximum zero-padded)
and per-slot scales (alpha / r; 0 in a slot whose adapter does not target that module).

Which slot each token uses is the step's ``LoRABatch``, read from the ``LoRAContext`` the model runner sets around
a forward, as attention reads its metadata; a step without adapter tokens leaves it None and costs one check.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from .batch import LoRABatch
from .kernels import add_lora


class LoRAContext:
    """The current step's ``LoRABatch``, shared by every ``LoRALinear`` of one model (None: no adapter tokens)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None

    @contextmanager
    def active(self, batch: LoRABatch | None) -> Iterator[None]:
        self.batch = batch
        try:
            yield
        finally:
            self.batch = None


@dataclass(frozen=True)
class LoRASlice:
    """One PEFT module's part of a projection's output: ``out_features`` columns from ``out_offset``."""

    module: str
    in_features: int
    out_features: int
    out_offset: int


class LoRALinear(nn.Module):
    """A projection plus the LoRA deltas of the adapters in its slots."""

    def __init__(
        self,
        base: nn.Module,
        slices: list[LoRASlice],
        max_loras: int,
        max_lora_rank: int,
        context: LoRAContext,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.slices = slices
        self.context = context
        self.max_lora_rank = max_lora_rank
        # On a CPU the adapters' small matmuls run in float32 even for a bf16/fp16 model: a [16, 576] x [576, 16]
        # product is ~2.5x faster in fp32 there (no small-shape half-precision kernels), and the delta is then
        # rounded once, onto the base output. On a GPU the stacks keep the model's dtype (tensor cores, Triton).
        if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
            dtype = torch.float32
        self.lora_dtype = dtype
        # Plain lists of buffers (not registered: they are not weights, and no state dict should carry them).
        self.a = [torch.zeros(max_loras, max_lora_rank, s.in_features, dtype=dtype, device=device) for s in slices]
        self.b = [torch.zeros(max_loras, s.out_features, max_lora_rank, dtype=dtype, device=device) for s in slices]
        self.scales = [torch.zeros(max_loras, dtype=torch.float32, device=device) for _ in slices]
        # Per slice, the slots whose adapter targets that module. A slice no resident adapter adapts is skipped:
        # most adapters target a few modules (peft's default for a Llama is q and v), and on a CPU each skipped
        # slice saves two small matmuls per layer and step, which cost more than the work they would add (zero).
        self.targeting: list[set[int]] = [set() for _ in slices]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.context.batch
        if batch is None or not batch.has_lora:
            return y
        xl = x if x.dtype == self.lora_dtype else x.to(self.lora_dtype)
        # A batch whose slots are read on the device (a decode CUDA graph) computes every slice: which slices the
        # resident adapters target may change after capture, and an untargeted slice's zero weights add nothing.
        every_slice = batch.slots_on_device
        for s, a, b, scales, targeting in zip(self.slices, self.a, self.b, self.scales, self.targeting, strict=True):
            if targeting or every_slice:
                add_lora(y, xl, a, b, scales, batch, out_offset=s.out_offset)
        return y

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> None:
        """Write one adapter's ``module -> (A [r, in], B [out, r])`` into ``slot`` (modules it lacks: zero)."""
        for s, a, b, scales, targeting in zip(self.slices, self.a, self.b, self.scales, self.targeting, strict=True):
            a[slot].zero_()
            b[slot].zero_()
            pair = weights.get(s.module)
            if pair is None:
                scales[slot] = 0.0
                targeting.discard(slot)
                continue
            targeting.add(slot)
            lora_a, lora_b = pair
            rank = lora_a.shape[0]
            a[slot, :rank].copy_(lora_a, non_blocking=True)
            b[slot, :, :rank].copy_(lora_b, non_blocking=True)
            scales[slot] = scale

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.a, *self.b, *self.scales))
