"""The engine's adapters: a CPU pool of loaded adapters (LRU beyond ``max_cpu_loras``) over the device slots.

* ``add`` (``LLM.add_lora``, and a request naming an adapter not loaded yet) checks and reads a PEFT folder into
  the CPU pool. An adapter that unfinished sequences (waiting or running) use is never evicted from the pool, so
  a queued request cannot find its adapter gone; past ``max_cpu_loras`` the least recently used unused one goes.
* The scheduler calls ``on_add`` / ``on_finish`` as sequences enter and leave, and ``acquire`` / ``release`` as
  they start and stop running: ``acquire`` pins the adapter into a device slot or says the sequence must wait.
* The model runner asks ``batch_for`` for the step's ``LoRABatch`` and sets it with ``context.active``, or, for a
  decode step replayed as a CUDA graph, ``row_slots`` for the slots it writes into the graph's buffer.

An id is the adapter's identity for the engine's life (it seeds the prefix cache's block hashes), so an id seen
before with another name is refused (another path is taken as a copy of the same adapter).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig

from ..core.sequence import Sequence
from .batch import LoRABatch
from .layers import LoRAContext
from .peft_files import AdapterWeights, LoRAError, load_adapter
from .request import LoRARequest
from .slots import DeviceSlots, wrap_model

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..models.loader import LoadedModel


@dataclass
class _PoolEntry:
    request: LoRARequest
    weights: AdapterWeights
    # Unfinished sequences (waiting or running) that use the adapter.
    refs: int = 0
    # remove_lora was called while sequences still used it: dropped when the last one leaves.
    removed: bool = False


class LoRAManager:
    """Adapters of one engine: CPU pool, device slots, and the LoRA layers wrapped into its model."""

    def __init__(
        self,
        model: torch.nn.Module,
        hf_config: PretrainedConfig,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.hf_config = hf_config
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.device = device
        self.context = LoRAContext()
        layers = wrap_model(model, hf_config, max_loras, max_lora_rank, self.context, dtype, device)
        self.slots = DeviceSlots(layers, max_loras)
        self._pool: OrderedDict[int, _PoolEntry] = OrderedDict()  # least recently used first
        self._seen: dict[int, LoRARequest] = {}
        self.num_cpu_loads = 0

    @classmethod
    def for_engine(cls, loaded: LoadedModel, config: EngineConfig) -> LoRAManager:
        """The adapters of an engine built from ``config`` around ``loaded`` (its projections get wrapped)."""
        assert config.max_cpu_loras is not None  # EngineConfig fills the default
        return cls(
            loaded.model,
            loaded.hf_config,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
            max_cpu_loras=config.max_cpu_loras,
            dtype=loaded.dtype,
            device=torch.device(config.device),
        )

    # ------------------------------------------------------------------ the pool (front-end calls)
    def add(self, request: LoRARequest) -> bool:
        """Load an adapter into the CPU pool; True when it was not loaded yet. ``LoRAError`` for a bad adapter or
        an id that named another adapter before."""
        # Only the name is held to the id: a worker may fetch the same adapter to another local folder.
        seen = self._seen.get(request.lora_int_id)
        if seen is not None and seen.lora_name != request.lora_name:
            raise LoRAError(
                f"lora_int_id {request.lora_int_id} already names adapter {seen.lora_name!r}; "
                "an id must keep naming the same adapter"
            )
        entry = self._pool.get(request.lora_int_id)
        if entry is not None:
            self._pool.move_to_end(request.lora_int_id)
            was_removed, entry.removed = entry.removed, False
            return was_removed
        weights = load_adapter(request.lora_path, self.hf_config, max_lora_rank=self.max_lora_rank)
        self._seen[request.lora_int_id] = request
        self._pool[request.lora_int_id] = _PoolEntry(request, weights)
        self.num_cpu_loads += 1
        self._trim(keep=request.lora_int_id)
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Unload an adapter (at once, or when its last unfinished sequence leaves); False when not loaded."""
        entry = self._pool.get(lora_int_id)
        if entry is None or entry.removed:
            return False
        if entry.refs:
            entry.removed = True
        else:
            self._drop(lora_int_id)
        return True

    def loaded(self) -> list[LoRARequest]:
        """Adapters loaded (CPU pool or device), least recently used first."""
        return [entry.request for entry in self._pool.values() if not entry.removed]

    @property
    def resident(self) -> list[int]:
        """Ids of the adapters in device slots."""
        return self.slots.resident

    def _drop(self, lora_int_id: int) -> None:
        del self._pool[lora_int_id]
        self.slots.drop(lora_int_id)

    def _trim(self, keep: int | None = None) -> None:
        """Evict least recently used adapters no unfinished sequence uses while the pool is over its size (an
        adapter in use stays, and ``keep``, just loaded: the pool may exceed ``max_cpu_loras`` meanwhile)."""
        excess = len(self._pool) - self.max_cpu_loras
        unused = [i for i, e in self._pool.items() if e.refs == 0 and i != keep]
        for lora_int_id in unused[: max(excess, 0)]:
            self._drop(lora_int_id)

    # ------------------------------------------------------------------ scheduler hooks
    def on_add(self, seq: Sequence) -> None:
        request = seq.lora_request
        assert request is not None
        if request.lora_int_id not in self._pool:
            self.add(request)  # evicted from the pool since its request was submitted
        entry = self._pool[request.lora_int_id]
        entry.refs += 1
        self._pool.move_to_end(request.lora_int_id)

    def on_finish(self, seq: Sequence) -> None:
        assert seq.lora_request is not None
        lora_int_id = seq.lora_request.lora_int_id
        entry = self._pool[lora_int_id]
        entry.refs -= 1
        if entry.refs == 0 and entry.removed:
            self._drop(lora_int_id)
        else:
            self._trim()

    def acquire(self, seq: Sequence) -> bool:
        """Pin the sequence's adapter into a device slot; False when every slot is pinned (it must wait)."""
        assert seq.lora_request is not None
        lora_int_id = seq.lora_request.lora_int_id
        return self.slots.acquire(lora_int_id, lambda: self._pool[lora_int_id].weights) is not None

    def release(self, seq: Sequence) -> None:
        assert seq.lora_request is not None
        self.slots.release(seq.lora_request.lora_int_id)

    # ------------------------------------------------------------------ model runner
    def batch_for(self, runs: list[tuple[Sequence, int]]) -> LoRABatch | None:
        """The step's ``LoRABatch`` for ``(sequence, new tokens)`` in token order; None when no token uses one."""
        if not any(seq.lora_request is not None for seq, _ in runs):
            return None
        return LoRABatch.from_runs([(self.slot_for(seq), n) for seq, n in runs], self.device)

    def row_slots(self, seqs: list[Sequence]) -> list[int] | None:
        """Each decode row's adapter slot (-1: base model), for a decode CUDA graph; None when no row uses one."""
        if not any(seq.lora_request is not None for seq in seqs):
            return None
        return [self.slot_for(seq) for seq in seqs]

    def slot_for(self, seq: Sequence) -> int:
        """The device slot of the sequence's adapter, -1 for a base-model sequence."""
        if seq.lora_request is None:
            return -1
        slot = self.slots.slot_of(seq.lora_request.lora_int_id)
        if slot is None:
            raise RuntimeError(f"request {seq.request_id} runs without its adapter in a device slot")
        return slot
