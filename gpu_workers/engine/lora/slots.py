"""Device slots: which ``max_loras`` adapters sit in the model's LoRA layers now, and which may be replaced.

``wrap_model`` puts a ``LoRALinear`` around every layer's ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and
``down_proj``. ``DeviceSlots`` keeps adapter id -> slot: an adapter is *pinned* while running sequences use it
(counted), and a slot is reused least recently used first among unpinned ones. When every slot is pinned,
``acquire`` says no and the scheduler leaves that sequence waiting (vLLM's max_loras admission rule).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from transformers import PretrainedConfig

from .layers import LoRAContext, LoRALinear, LoRASlice
from .peft_files import AdapterWeights, module_dims

# Wrapped projection -> the PEFT modules laid side by side in its output, in order.
_MERGED: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}


def wrap_model(
    model: torch.nn.Module,
    hf_config: PretrainedConfig,
    max_loras: int,
    max_lora_rank: int,
    context: LoRAContext,
    dtype: torch.dtype,
    device: torch.device,
) -> list[list[LoRALinear]]:
    """Wrap every layer's projections in place; returns the wrappers per layer."""
    dims = module_dims(hf_config)
    wrapped: list[list[LoRALinear]] = []
    for layer in model.model.layers:  # type: ignore[union-attr]
        row = []
        for name, (parent_name, modules) in _MERGED.items():
            parent = getattr(layer, parent_name)
            slices, offset = [], 0
            for module in modules:
                in_f, out_f = dims[module]
                slices.append(LoRASlice(module, in_f, out_f, offset))
                offset += out_f
            lora = LoRALinear(getattr(parent, name), slices, max_loras, max_lora_rank, context, dtype, device)
            setattr(parent, name, lora)
            row.append(lora)
        wrapped.append(row)
    return wrapped


class DeviceSlots:
    """``max_loras`` slots across every wrapped layer, assigned to adapter ids on demand."""

    def __init__(self, layers: list[list[LoRALinear]], max_loras: int) -> None:
        self.layers = layers
        self.max_loras = max_loras
        # Adapter id -> slot, least recently acquired first.
        self._slot_of: OrderedDict[int, int] = OrderedDict()
        self._pins: dict[int, int] = {}
        self._free = list(range(max_loras))
        self.num_loads = 0

    def slot_of(self, lora_int_id: int) -> int | None:
        return self._slot_of.get(lora_int_id)

    @property
    def resident(self) -> list[int]:
        return list(self._slot_of)

    def acquire(self, lora_int_id: int, weights: Callable[[], AdapterWeights]) -> int | None:
        """Pin the adapter into a slot (loading it there, over the least recently used unpinned adapter, if it is
        not resident); None when every slot is pinned."""
        slot = self._slot_of.get(lora_int_id)
        if slot is None:
            slot = self._take_slot()
            if slot is None:
                return None
            self._load(slot, weights())
            self._slot_of[lora_int_id] = slot
        self._slot_of.move_to_end(lora_int_id)
        self._pins[lora_int_id] = self._pins.get(lora_int_id, 0) + 1
        return slot

    def release(self, lora_int_id: int) -> None:
        """One running sequence of the adapter left (finished or preempted); it stays resident."""
        pins = self._pins.get(lora_int_id, 0) - 1
        if pins < 0:
            raise RuntimeError(f"LoRA adapter {lora_int_id} released more often than acquired")
        if pins == 0:
            del self._pins[lora_int_id]
        else:
            self._pins[lora_int_id] = pins

    def drop(self, lora_int_id: int) -> None:
        """Forget an unpinned adapter's slot (it left the CPU pool); its slot becomes free."""
        if self._pins.get(lora_int_id):
            raise RuntimeError(f"LoRA adapter {lora_int_id} is in use by running sequences")
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is not None:
            self._free.append(slot)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for victim in self._slot_of:  # least recently used first
            if not self._pins.get(victim):
                return self._slot_of.pop(victim)
        return None

    def _load(self, slot: int, weights: AdapterWeights) -> None:
        scale = weights.spec.scale
        for i, row in enumerate(self.layers):
            for lora in row:
                modules = {s.module: weights.modules[(i, s.module)] for s in lora.slices
                           if (i, s.module) in weights.modules}  # fmt: skip
                lora.set_slot(slot, modules, scale)
        self.num_loads += 1
