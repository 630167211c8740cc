"""The per-step token-to-slot map of the batched multi-LoRA delta: :class:`LoRABatch`.

One step's flat batch may mix sequences of several adapters and of the base model (slot ``-1``). The model runner
builds a :class:`LoRABatch` once per step from the per-sequence runs; it holds everything the per-layer calls of
``kernels.add_lora`` (torch) and ``triton_lora`` (Triton) need, precomputed, so those calls do no host work beyond a
few attribute reads. Both kernel modules read it and neither is read by it, so it stands in a module of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The torch path takes the per-segment strategy when LoRA segments average at least this many tokens.
# Below it, per-segment op overhead (two matmuls per segment) exceeds the cost of gathering per-token
# weights; measured with benchmarks/lora_kernels.py on SmolLM2-135M's shapes (see the report there).
SEGMENT_MIN_AVG_TOKENS = 8


@dataclass(frozen=True)
class LoRABatch:
    """Which adapter slot each token of a flat step batch uses; built once per step by the model runner.

    ``token_slots`` is the per-token map (-1 = base model). The rest is derived metadata:
    LoRA segments (maximal runs of tokens of one slot >= 0; base runs are dropped) as device tensors
    for the Triton kernels and python tuples for the torch path, and the gather path's indices.
    """

    token_slots: torch.Tensor  # [T] int64, -1 = base model
    num_tokens: int
    # LoRA segments, in token order (int32 device tensors for Triton, tuples for the torch loop).
    seg_starts: torch.Tensor
    seg_lens: torch.Tensor
    seg_slots: torch.Tensor
    seg_starts_list: tuple[int, ...]
    seg_lens_list: tuple[int, ...]
    seg_slots_list: tuple[int, ...]
    max_seg_len: int
    # Gather path: the tokens that use an adapter and their slots ([L] int64 device tensors).
    lora_tokens: torch.Tensor
    lora_slots: torch.Tensor
    num_lora_tokens: int
    max_slot: int  # -1 when no token uses an adapter, or when unknown on the host (``per_row``)
    use_segments: bool  # the torch path's strategy for this step
    # ``per_row``: the slots live only in device memory and may be -1 (base or padding row), so the host lists
    # hold no slots and every row counts as an adapter token (the gather path masks the -1 rows).
    slots_on_device: bool = False

    @property
    def num_segments(self) -> int:
        """Segments the Triton kernels' grid covers (host int)."""
        return len(self.seg_lens_list)

    @classmethod
    def per_row(cls, slots: torch.Tensor, starts: torch.Tensor, ones: torch.Tensor) -> LoRABatch:
        """A decode batch of ``len(slots)`` one-token rows whose adapter slots are read from ``slots`` (int32 device
        tensor, -1 = base model) when the kernels run, not when the batch is built: the form a CUDA graph captures
        once and replays with new slots. ``starts`` must hold ``0..len(slots)-1`` and ``ones`` ones (int32, as long)."""
        rows = slots.shape[0]
        if starts.shape[0] != rows or ones.shape[0] != rows:
            raise ValueError(f"per-row LoRA batch: {rows} slots, {starts.shape[0]} starts, {ones.shape[0]} lengths")
        return cls(
            token_slots=slots,
            num_tokens=rows,
            seg_starts=starts,
            seg_lens=ones,
            seg_slots=slots,
            seg_starts_list=tuple(range(rows)),
            seg_lens_list=(1,) * rows,
            seg_slots_list=(),
            max_seg_len=1,
            lora_tokens=starts,
            lora_slots=slots,
            num_lora_tokens=rows,
            max_slot=-1,
            use_segments=False,
            slots_on_device=True,
        )

    @classmethod
    def from_runs(cls, runs: list[tuple[int, int]], device: torch.device | str) -> LoRABatch:
        """``runs`` = ``(slot, num_tokens)`` per sequence in the step's token order (a sequence's tokens are
        contiguous); slot -1 = base model. Consecutive runs of one slot merge into one segment."""
        device = torch.device(device)
        starts: list[int] = []
        lens: list[int] = []
        slots: list[int] = []
        token_slots: list[int] = []
        lora_tokens: list[int] = []
        lora_slots: list[int] = []
        pos = 0
        for slot, n in runs:
            if n <= 0:
                raise ValueError(f"LoRA run of {n} tokens (slot {slot}): every sequence contributes at least one")
            if slot < -1:
                raise ValueError(f"LoRA slot {slot}: slots are >= 0, or -1 for the base model")
            if slot >= 0:
                if slots and slots[-1] == slot and starts[-1] + lens[-1] == pos:
                    lens[-1] += n
                else:
                    starts.append(pos)
                    lens.append(n)
                    slots.append(slot)
                lora_tokens.extend(range(pos, pos + n))
                lora_slots.extend([slot] * n)
            token_slots.extend([slot] * n)
            pos += n

        def dev(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        num_lora = len(lora_tokens)
        return cls(
            token_slots=dev(token_slots, torch.int64),
            num_tokens=pos,
            seg_starts=dev(starts, torch.int32),
            seg_lens=dev(lens, torch.int32),
            seg_slots=dev(slots, torch.int32),
            seg_starts_list=tuple(starts),
            seg_lens_list=tuple(lens),
            seg_slots_list=tuple(slots),
            max_seg_len=max(lens, default=0),
            lora_tokens=dev(lora_tokens, torch.int64),
            lora_slots=dev(lora_slots, torch.int64),
            num_lora_tokens=num_lora,
            max_slot=max(slots, default=-1),
            use_segments=bool(slots) and num_lora >= SEGMENT_MIN_AVG_TOKENS * len(slots),
        )

    @property
    def has_lora(self) -> bool:
        """True when any token uses an adapter slot (otherwise ``kernels.add_lora`` is a no-op)."""
        return self.num_lora_tokens > 0
