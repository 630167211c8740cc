"""Running tensor-parallel ranks: rank 0 is the engine (scheduler, sampler, its own shard); ranks 1.. are
processes that hold their shards and KV caches and do what rank 0 tells them, in the same order.

Rank 0's ``TPModelRunner`` broadcasts every operation that runs the model or touches the KV cache before doing
it itself: each step's plan (the flat token ids, positions, slot mapping, block tables and the rest of the
attention metadata: lists of ints, no tensors and no sequences), cache allocation and the memory profile (the
ranks take the smallest block count any of them can hold), decode setup, and block copies. The other ranks run
``follower_main``: receive, do, repeat. The forward passes then meet in the parallel layers' collectives.

A rank that dies breaks the group: the next collective on rank 0 raises, the engine's step fails, and the
worker treats it as an engine failure (its requests go back to Kafka and resume on another worker). When rank 0
goes away, the others' pending receive fails and they exit.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import weakref
from typing import Any

import torch
from transformers import AutoConfig

from ..attention import get_attention_backend
from ..config import EngineConfig
from ..execution.model_runner import ModelRunner
from ..execution.step_inputs import PreparedBatch
from ..models import ARCHITECTURE_INFO, check_features, resolve_architecture_name
from ..models.loader import LoadedModel, load_model, resolve_model_path
from .group import TPGroup, free_port
from .shard import TPShard

log = logging.getLogger(__name__)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    device = torch.device(config.device)
    return torch.device("cuda", rank) if device.type == "cuda" else device


class TensorParallelRanks:
    """Rank 0's handle on the group and on the processes of ranks 1..; ``stop`` ends them."""

    def __init__(self, config: EngineConfig) -> None:
        world = config.tensor_parallel_size
        # A model that cannot run sharded, or whose heads do not divide over the ranks, is refused before any
        # process starts.
        hf_config = AutoConfig.from_pretrained(str(resolve_model_path(config.model)))
        check_features(ARCHITECTURE_INFO[resolve_architecture_name(getattr(hf_config, "architectures", None))], config)
        TPShard.plan(hf_config, 0, world)
        port = free_port()
        context = multiprocessing.get_context("spawn")
        self.processes = [
            context.Process(
                target=follower_main,
                args=(config, rank, port, torch.get_num_threads()),
                name=f"sluicegate-tp-rank{rank}",
                daemon=False,
            )
            for rank in range(1, world)
        ]
        for process in self.processes:
            process.start()
        self.group = TPGroup(0, world, port, rank_device(config, 0), config.tensor_parallel_timeout_s)
        self._finalizer = weakref.finalize(self, _stop, self.group, self.processes)

    def stop(self) -> None:
        self._finalizer()


def _stop(group: TPGroup, processes: list[Any]) -> None:
    try:
        group.broadcast_object(("stop",))
    except Exception:  # a rank is gone already: the others leave on the broken group
        pass
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()


class TPModelRunner(ModelRunner):
    """Rank 0's model runner: everything the other ranks must mirror is broadcast to them first."""

    def __init__(self, loaded: LoadedModel, backend: Any, block_size: int, kv_dtype: Any, group: TPGroup) -> None:
        super().__init__(loaded, backend, block_size, kv_dtype)
        self.group = group
        self._profiling = False

    def decode_graphs_unsupported(self, config: EngineConfig) -> str | None:
        return "tensor parallelism (every rank runs its steps eagerly)"

    def profile_num_blocks(self, config: EngineConfig, max_model_len: int, extra_bytes_per_block: int = 0) -> int:
        self.group.broadcast_object(("profile", max_model_len))
        self._profiling = True
        try:
            own = super().profile_num_blocks(config, max_model_len, extra_bytes_per_block)
        finally:
            self._profiling = False
        return self.group.all_reduce_min(own)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        if not self._profiling:  # the profile's own throw-away cache is allocated by each rank's profile
            self.group.broadcast_object(("allocate", num_blocks))
        super().allocate_kv_cache(num_blocks)

    def setup_decode(self, config: EngineConfig, max_model_len: int) -> None:
        self.group.broadcast_object(("setup_decode", max_model_len))
        super().setup_decode(config, max_model_len)

    def copy_block(self, src: int, dst: int) -> None:
        self.group.broadcast_object(("copy_block", src, dst))
        super().copy_block(src, dst)

    def _build(self, *args: Any, **kwargs: Any) -> PreparedBatch:
        # The step's plan, exactly as this rank builds its inputs from it; the sequences stay here (ranks 1..
        # only need to know whether logits are computed, for the LM head's all-gather).
        input_ids, positions, slots, query_start, seq_lens, tables, logits_rows, sample, max_q = args
        plan = (input_ids, positions, slots, query_start, seq_lens, tables, logits_rows, max_q, kwargs)
        self.group.broadcast_object(("step", plan, bool(sample)))
        return super()._build(*args, **kwargs)


def follower_main(config: EngineConfig, rank: int, port: int, threads: int) -> None:
    """Rank ``rank`` (>= 1): load the shard, then mirror rank 0's operations until told to stop. ``threads``:
    rank 0's torch thread count (a spawned process would otherwise take every core)."""
    torch.set_num_threads(threads)
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config = dataclasses.replace(config, device=device)
    group = TPGroup(rank, config.tensor_parallel_size, port, device, config.tensor_parallel_timeout_s)
    loaded = load_model(config, group)
    kv_dtype = config.kv_cache_torch_dtype
    backend = get_attention_backend(config.attention_backend, device, config.block_size, loaded.dtype, kv_dtype)
    runner = ModelRunner(loaded, backend, config.block_size, kv_dtype)
    model = loaded.model
    try:
        while True:
            command = group.broadcast_object()
            kind = command[0]
            if kind == "step":
                (input_ids, positions, slots, query_start, seq_lens, tables, logits_rows, max_q, kw), logits = command[
                    1:
                ]
                prepared = runner._build(
                    input_ids, positions, slots, query_start, seq_lens, tables, logits_rows, [], max_q, **kw
                )
                with torch.inference_mode():
                    hidden = model(prepared.input_ids, prepared.positions, prepared.meta)
                    if logits:
                        model.compute_logits(hidden[prepared.logits_indices])
            elif kind == "profile":
                group.all_reduce_min(runner.profile_num_blocks(config, command[1]))
            elif kind == "allocate":
                runner.allocate_kv_cache(command[1])
            elif kind == "setup_decode":
                runner.setup_decode(dataclasses.replace(config, enforce_eager=True), command[1])
            elif kind == "copy_block":
                runner.copy_block(command[1], command[2])
            elif kind == "stop":
                return
            else:
                raise RuntimeError(f"unknown tensor-parallel command {kind!r}")
    except RuntimeError as exc:
        # Rank 0 went away (or another rank did): the group is broken, nothing is left to serve.
        log.warning("tensor-parallel rank %d leaving: %s", rank, exc)
