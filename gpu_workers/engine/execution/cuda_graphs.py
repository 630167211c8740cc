"""CUDA graphs for decode steps: the model forward of a pure-decode batch, captured once per
bucketed batch size and replayed with new inputs copied into static buffers.

A decode step launches hundreds of small kernels (a few per layer) whose CPU launch cost is
comparable to their GPU time at small batch sizes; replaying a captured graph issues them all at
once. Capture fixes every tensor address and every host-side launch decision, so:

* Inputs live in static buffers (``StaticDecodeBuffers``) sized for the largest bucket:
  ``input_ids``, ``positions``, ``slot_mapping``, ``seq_lens``, ``query_start_loc`` (always
  ``0..size``), ``block_tables`` (``max_model_len`` wide) and the shared-prefix length. Each step
  writes its rows there through one pinned host staging buffer per dtype.
* A batch of ``n`` sequences runs the graph of the smallest bucket ``>= n``. Padding rows get slot
  ``-1`` (the attention protocol's "do not store"), token 0 at position 0, ``seq_len`` 1 and
  whatever block ids their block-table row still holds from earlier steps (always valid ids, and
  only position 0 is read), so their attention stays finite and their outputs are ignored.
* Host-side decisions baked into the graph use bounds: ``max_seq_len`` is ``max_model_len`` (it
  only sizes the split-KV grid; the kernels read real lengths from ``seq_lens``).
* With a backend that has a cascade path, buckets of two or more rows get a second graph that
  runs cascade attention reading the shared-prefix length from device memory; the runner picks it
  when the batch shares a prefix (see ``ModelRunner``), the plain graph otherwise.
* With LoRA adapters (``lora=`` the model's ``LoRAContext``), every bucket also gets a graph with the LoRA
  layers on: a per-row ``LoRABatch`` reads each row's adapter slot from a static buffer (-1 for base and
  padding rows), so one graph serves any mix of resident adapters. Eager, such a step pays two kernel
  launches per adapted projection slice: on an H100 the adapters took ~8x the base linears' time eagerly and 9x
  less than that inside a graph (docs/benchmarks.md).

Only decode-only batches replay graphs; prefill and mixed steps run eagerly. Graphs are captured
on CUDA only, after the KV cache is allocated (its addresses are baked in), with the attention
backends whose decode path never syncs with the host (Triton, flash-attn), and not with
bitsandbytes layers (their int8 matmul inspects activations on the host). ``enforce_eager=True``
turns them off. Without capture (``capture=False``) the same padded static-buffer forward runs
eagerly, which is how the padding logic is checked on a CPU.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..attention.metadata import AttentionMetadata
from ..lora.batch import LoRABatch
from ..lora.layers import LoRAContext

logger = logging.getLogger(__name__)

# Batch sizes up to the first step are captured one by one (powers of two below it), then
# every multiple of the step: padding a batch costs little in a weight-bandwidth-bound step.
GRAPH_SIZE_STEP = 16

ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Bucketed batch sizes to capture: 1, 2, 4, 8, then multiples of 16, and ``max_num_seqs``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1; got {max_num_seqs}")
    sizes = {s for s in (1, 2, 4, 8) if s < max_num_seqs}
    sizes.update(range(GRAPH_SIZE_STEP, max_num_seqs, GRAPH_SIZE_STEP))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` rows, or None when none does."""
    if num_seqs < 1:
        raise ValueError(f"a decode batch needs at least one sequence; got {num_seqs}")
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


@dataclass
class DecodeRows:
    """Host-side inputs of one decode step, one entry per sequence (the batch's real rows)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    # Whole-block prefix all rows share physically (0: none, or cascade not wanted).
    common_prefix_len: int = 0
    # Each row's LoRA adapter slot (-1: the base model); None when no row uses an adapter.
    lora_slots: list[int] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


class StaticDecodeBuffers:
    """Fixed-address device tensors a captured decode graph reads, plus their host staging."""

    def __init__(
        self, max_batch: int, max_blocks_per_seq: int, block_size: int, device: torch.device, *, lora: bool = False
    ) -> None:
        self.max_batch = max_batch
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.device = device
        # int64 rows: input ids, positions, slots. int32: seq_lens then the shared-prefix length.
        self._i64 = torch.zeros((3, max_batch), dtype=torch.int64, device=device)
        self._i64[2].fill_(-1)
        self._i32 = torch.ones(max_batch + 1, dtype=torch.int32, device=device)
        self._i32[max_batch] = 0
        self.input_ids = self._i64[0]
        self.positions = self._i64[1]
        self.slot_mapping = self._i64[2]
        self.seq_lens = self._i32[:max_batch]
        self.prefix_len = self._i32[max_batch:]
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_batch, max_blocks_per_seq), dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self._host_i64 = torch.empty((3, max_batch), dtype=torch.int64, pin_memory=pin)
        self._host_i32 = torch.empty(max_batch + 1, dtype=torch.int32, pin_memory=pin)
        self._host_i64.copy_(self._i64)
        self._host_i32.copy_(self._i32)
        # LoRA: each row's adapter slot (-1: base model or padding), and the per-row segments' constant lengths.
        self.lora_slots: torch.Tensor | None = None
        if lora:
            self.lora_slots = torch.full((max_batch,), -1, dtype=torch.int32, device=device)
            self._lora_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
            self._host_lora = torch.full((max_batch,), -1, dtype=torch.int32, pin_memory=pin)
        # Block tables are staged compactly ([rows, used width]) so a step copies only what it uses.
        self._host_tables = torch.empty(max_batch * max_blocks_per_seq, dtype=torch.int32, pin_memory=pin)
        # Marks when the last copies out of the staging buffers are done; a step that samples
        # nothing never syncs, so the next load must not overwrite staging still being read.
        self._copied: torch.cuda.Event | None = None

    def metadata(self, batch_size: int, max_seq_len: int, cascade: bool) -> AttentionMetadata:
        """Metadata viewing the first ``batch_size`` rows; fixed for the life of a graph."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            max_query_len=1,
            max_seq_len=max_seq_len,
            is_decode_only=True,
            # Any positive multiple of the block size switches the cascade path on; the length
            # itself is read from prefix_len when the graph runs.
            common_prefix_len=self.block_size if cascade else 0,
            common_prefix_len_device=self.prefix_len if cascade else None,
        )

    def lora_batch(self, batch_size: int) -> LoRABatch:
        """The per-row ``LoRABatch`` of the first ``batch_size`` rows; fixed for the life of a graph."""
        if self.lora_slots is None:
            raise RuntimeError("these decode buffers were built without LoRA slots")
        return LoRABatch.per_row(
            self.lora_slots[:batch_size], self.query_start_loc[:batch_size], self._lora_lens[:batch_size]
        )

    def load(self, rows: DecodeRows, batch_size: int) -> None:
        """Write ``rows`` into the first ``len(rows)`` slots and padding into the rest up to
        ``batch_size`` (asynchronous on CUDA: the host staging is pinned)."""
        n = len(rows)
        if not 1 <= n <= batch_size <= self.max_batch:
            raise ValueError(f"cannot load {n} rows into a batch of {batch_size} (capacity {self.max_batch})")
        width = max(len(t) for t in rows.block_tables)
        if width > self.max_blocks_per_seq:
            raise ValueError(f"a block table of {width} blocks exceeds the static width {self.max_blocks_per_seq}")
        host64, host32 = self._host_i64, self._host_i32
        if self._copied is not None:
            self._copied.synchronize()
        pad = batch_size - n
        host64[0, :batch_size] = torch.tensor(rows.input_ids + [0] * pad, dtype=torch.int64)
        host64[1, :batch_size] = torch.tensor(rows.positions + [0] * pad, dtype=torch.int64)
        host64[2, :batch_size] = torch.tensor(rows.slots + [-1] * pad, dtype=torch.int64)
        host32[:batch_size] = torch.tensor(rows.seq_lens + [1] * pad, dtype=torch.int32)
        host32[self.max_batch] = rows.common_prefix_len
        # Whole buffers (a few KiB, contiguous): rows past batch_size are not read by this bucket.
        self._i64.copy_(host64, non_blocking=True)
        self._i32.copy_(host32, non_blocking=True)
        if self.lora_slots is not None:
            self._host_lora[:batch_size] = torch.tensor((rows.lora_slots or [-1] * n) + [-1] * pad, dtype=torch.int32)
            self.lora_slots.copy_(self._host_lora, non_blocking=True)
        elif rows.lora_slots is not None:
            raise ValueError("a decode batch with LoRA slots, but these buffers were built without them")
        # Entries past a row's own blocks are never read, so only the used width is written.
        host_tables = self._host_tables[: n * width].view(n, width)
        host_tables.copy_(torch.tensor([t + [0] * (width - len(t)) for t in rows.block_tables], dtype=torch.int32))
        self.block_tables[:n, :width].copy_(host_tables, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()


class DecodeGraphRunner:
    """Runs decode batches of up to ``max(sizes)`` rows through per-bucket captured graphs."""

    def __init__(
        self,
        forward: ForwardFn,
        sizes: list[int],
        max_model_len: int,
        block_size: int,
        device: torch.device,
        *,
        cascade: bool,
        capture: bool = True,
        lora: LoRAContext | None = None,
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.forward = forward
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.cascade = cascade
        self.capture_enabled = capture
        self.lora = lora
        blocks = -(-max_model_len // block_size)
        self.buffers = StaticDecodeBuffers(self.sizes[-1], blocks, block_size, device, lora=lora is not None)
        # Keyed by (batch size, cascade, LoRA layers on).
        self._graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, bool, bool], torch.Tensor] = {}
        self.num_replays = 0

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def variants(self, size: int) -> list[tuple[bool, bool]]:
        """(cascade, LoRA) variants worth having for a bucket: cascade needs two rows, LoRA an engine with adapters."""
        cascades = [False, True] if self.cascade and size >= 2 else [False]
        loras = [False, True] if self.lora is not None else [False]
        return [(cascade, lora) for cascade in cascades for lora in loras]

    def _lora_active(self, size: int, with_lora: bool) -> contextlib.AbstractContextManager[None]:
        """The LoRA layers' per-row batch around a forward of a LoRA variant; nothing for the others."""
        if not with_lora or self.lora is None:
            return contextlib.nullcontext()
        return self.lora.active(self.buffers.lora_batch(size))

    def capture(self) -> None:
        """Capture every bucket, largest first, all in one memory pool (graphs replay one at a
        time, so they can share intermediate memory)."""
        if not self.capture_enabled:
            return
        pool = torch.cuda.graph_pool_handle()
        buf = self.buffers
        with torch.inference_mode():
            for size in reversed(self.sizes):
                for cascade, with_lora in self.variants(size):
                    meta = buf.metadata(size, self.max_model_len, cascade)
                    ids, positions = buf.input_ids[:size], buf.positions[:size]
                    with self._lora_active(size, with_lora):
                        # A real run first: compiles kernels and settles lazily built state outside capture.
                        self.forward(ids, positions, meta)
                        torch.cuda.synchronize(buf.device)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=pool):
                            out = self.forward(ids, positions, meta)
                    self._graphs[(size, cascade, with_lora)] = graph
                    self._outputs[(size, cascade, with_lora)] = out
        torch.cuda.synchronize(buf.device)
        logger.info("captured %d decode CUDA graphs for batch sizes %s", len(self._graphs), self.sizes)

    def run(self, rows: DecodeRows) -> torch.Tensor:
        """Hidden states ``[len(rows), hidden]`` of one decode step (a view into graph memory,
        valid until the next call)."""
        n = len(rows)
        size = bucket_for(n, self.sizes)
        if size is None:
            raise ValueError(f"decode batch of {n} rows exceeds the largest captured size {self.max_batch}")
        cascade = self.cascade and rows.common_prefix_len > 0
        with_lora = rows.lora_slots is not None
        if with_lora and self.lora is None:
            raise ValueError("a decode batch with LoRA slots, but this runner has no LoRA layers")
        self.buffers.load(rows, size)
        key = (size, cascade, with_lora)
        graph = self._graphs.get(key)
        if graph is None:
            # Not captured (capture=False): the same padded inputs, run eagerly.
            buf = self.buffers
            meta = buf.metadata(size, self.max_model_len, cascade)
            with torch.inference_mode(), self._lora_active(size, with_lora):
                return self.forward(buf.input_ids[:size], buf.positions[:size], meta)[:n]
        graph.replay()
        self.num_replays += 1
        return self._outputs[key][:n]
