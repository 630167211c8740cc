"""Pure-torch reference attention over the paged KV cache (the CPU backend).

Prefill chunks read each sequence's context straight out of the cache: its block table is split
into runs of consecutive blocks (the block manager keeps a sequence's blocks consecutive when it
can), and a run is a plain view of the flat ``[slots, kv_heads, head_dim]`` cache, so a
well-placed sequence costs no copy at all; only a fragmented one concatenates its runs. They use
``scaled_dot_product_attention(enable_gqa=True)`` with a causal mask offset by the cached context.

Decode rows (one query each) go through one attention call for the whole step: their contexts are
gathered into a ``[rows, kv_heads, max_ctx, head_dim]`` batch with the padding masked. A call per
row costs more in dispatch than the gather copies while contexts are short or alike (chat decode);
where one long context would make the padding dominate (``_MAX_PADDING_RATIO``), the rows loop
over views instead. Either way the query heads that share a KV head fold into the query-length
axis (a single query needs no causal mask), so grouped-query attention needs no K/V copies. The
runs and the decode batch are worked out once per step and reused by every layer.

With an FP8 cache (``kv_quant.py``) new rows are quantized as they are written, and a sequence's
context is widened as it is read (to fp32 on a CPU, with integer ops that vectorize where torch's
float8 cast does not); the per-head scales are folded into the query (K's) and the output (V's)
rather than multiplied into every cached element. A prompt attended whole
in one step uses its fresh K/V, as with any cache dtype.

A sliding-window layer (``sliding_window=W``: query position ``p`` sees keys ``p - W < k <= p``, as
transformers' mask) reads only the slots from its first query's window start on, so blocks released
behind the window are never touched; prefill rows add the window's lower bound to their mask. Runs and
decode batches are planned once per step and window (a model mixing full and sliding layers has two).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .gathered_decode import attend_decode_gathered
from .gathered_invariant import attend_rows_invariant
from .kv_quant import FP8_AS_FP16_FACTOR, calibrate_scales, fp8_codes_as, is_fp8_cache, quantize_rows
from .metadata import AttentionMetadata
from .per_token import attend_per_token

# Flat slot ranges [start, end) that, concatenated, hold one sequence's context in order.
SlotRuns = list[tuple[int, int]]


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    skips_slots: bool | None = None,
) -> None:
    """Store this step's K/V at their slots; slots of -1 are skipped. An FP8 cache needs the
    layer's per-head scales and stores the rows quantized with them. ``skips_slots`` says whether
    any slot is -1 when the caller knows (else it is checked, a host sync on a device)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    if skips_slots if skips_slots is not None else bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    if is_fp8_cache(k_cache):
        if k_scale is None or v_scale is None:
            raise ValueError("an FP8 KV cache needs k_scale and v_scale to write")
        # index_copy_ has no float8 kernel on CPU; the same bytes go in as uint8.
        flat_k.view(torch.uint8).index_copy_(0, slot_mapping, quantize_rows(k, k_scale).view(torch.uint8))
        flat_v.view(torch.uint8).index_copy_(0, slot_mapping, quantize_rows(v, v_scale).view(torch.uint8))
        return
    flat_k.index_copy_(0, slot_mapping, k)
    flat_v.index_copy_(0, slot_mapping, v)


def context_runs(block_table: list[int], seq_len: int, block_size: int, first_pos: int = 0) -> SlotRuns:
    """Split the slots of positions ``[first_pos, seq_len)`` of a sequence into runs of consecutive
    cache slots (table entries before ``first_pos``'s block are not looked at: they may be released)."""
    first_block = first_pos // block_size
    num_blocks = -(-seq_len // block_size)
    runs: SlotRuns = []
    start = prev = block_table[first_block]
    for block in block_table[first_block + 1 : num_blocks]:
        if block != prev + 1:
            runs.append((start * block_size, (prev + 1) * block_size))
            start = block
        prev = block
    runs.append((start * block_size, (prev + 1) * block_size))
    # The last block is only partly filled: trim the final run to the context length; the first
    # may start inside its block.
    excess = num_blocks * block_size - seq_len
    last_start, last_end = runs[-1]
    runs[-1] = (last_start, last_end - excess)
    first_start, first_end = runs[0]
    runs[0] = (first_start + first_pos % block_size, first_end)
    return runs


def window_starts(seq_lens: list[int], query_start: list[int], window: int | None) -> list[int]:
    """Per sequence, the first position its earliest query of the step can see (0 without a window)."""
    if window is None:
        return [0] * len(seq_lens)
    return [max(0, n - (query_start[i + 1] - query_start[i]) - window + 1) for i, n in enumerate(seq_lens)]


def attend_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[q, k]`` bool: causal, and inside the sliding window when there is one."""
    mask = k_positions[None, :] <= q_positions[:, None]
    if window is not None:
        mask &= k_positions[None, :] > q_positions[:, None] - window
    return mask


def _read(flat_cache: torch.Tensor, runs: SlotRuns) -> torch.Tensor:
    """``[ctx, kv_heads, head_dim]`` context of one sequence: a view when it is one run."""
    if len(runs) == 1:
        start, end = runs[0]
        return flat_cache[start:end]
    return torch.cat([flat_cache[start:end] for start, end in runs])


class TorchAttentionBackend:
    """Reference backend; correct on any device, tuned for CPU serving of small models."""

    name = "torch"

    def __init__(self) -> None:
        # Per-step plans, rebuilt when a new metadata object arrives (the model runner makes one
        # per step and every layer receives the same one), one per sliding window in use.
        # A hybrid KV cache has one metadata per layer group: each is planned once per step on its own.
        self._group_states: dict[int, _GroupPlans] = {}
        self._skips_slots = False
        # The deterministic mode (execution/batch_invariant.py): every query token attends alone over its cached
        # context (per_token.py), never in a padded decode batch nor over a prompt's fresh keys.
        self.batch_invariant = False

    def _plan_for(
        self,
        meta: AttentionMetadata,
        block_size: int,
        seq_lens: list[int],
        query_start: list[int],
        window: int | None,
    ) -> StepPlan:
        state = self._group_states.get(meta.kv_group)
        if state is None or state.meta is not meta:
            # One host sync per step instead of one per layer in write_kv.
            state = _GroupPlans(meta, meta.block_tables.tolist(), {}, bool((meta.slot_mapping < 0).any()))
            self._group_states[meta.kv_group] = state
        self._skips_slots = state.skips_slots
        plan = state.plans.get(window)
        if plan is None:
            starts = window_starts(seq_lens, query_start, window)
            runs = [context_runs(state.tables[i], n, block_size, starts[i]) for i, n in enumerate(seq_lens)]
            ctx_lens = [n - lo for n, lo in zip(seq_lens, starts, strict=True)]
            decode = (
                None
                if self.batch_invariant
                else DecodeBatch.plan(runs, ctx_lens, query_start, meta.slot_mapping.device)
            )
            plan = state.plans[window] = StepPlan(runs, starts, decode)
        return plan

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        if meta.compiled_decode:
            attend = attend_decode_gathered if meta.fresh_from is None else attend_rows_invariant
            return attend(q, k, v, k_cache, v_cache, meta, scale)
        fp8 = is_fp8_cache(k_cache)
        if fp8 and meta.calibrate_kv_scales and k_scale is not None and v_scale is not None:
            calibrate_scales(k, v, k_scale, v_scale)
        query_start = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
        block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        num_heads = q.shape[1]
        group = num_heads // num_kv_heads
        plan = self._plan_for(meta, block_size, seq_lens, query_start, sliding_window)
        runs = plan.runs
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale, skips_slots=self._skips_slots)
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        # FP8: q @ (s_k K)^T = (s_k q) @ K^T and P @ (s_v V) = s_v (P @ V), per KV head, so the
        # cached context is only widened (fp8_codes_as, whose factor joins the scales); these
        # multiply the query and output (per decode row [kv_heads, 1, 1], per prefill chunk
        # [heads, 1, 1]). A CPU computes these rows in fp32 (16-bit math there is slower).
        work = torch.float32 if q.device.type == "cpu" else q.dtype
        k_rows = v_rows = k_heads = v_heads = None
        if fp8 and k_scale is not None and v_scale is not None:  # (write_kv refused missing scales)
            k_rows = (k_scale * FP8_AS_FP16_FACTOR).to(work)[:, None, None]
            v_rows = (v_scale * FP8_AS_FP16_FACTOR).to(work)[:, None, None]
            k_heads = k_rows.repeat_interleave(group, dim=0)
            v_heads = v_rows.repeat_interleave(group, dim=0)
        if self.batch_invariant:
            return attend_per_token(
                q, lambda i: (_read(flat_k, runs[i]), _read(flat_v, runs[i])), query_start, seq_lens, scale,
                k_rows, v_rows, work, plan.starts, sliding_window,
            )  # fmt: skip
        out = torch.empty_like(q)
        batched = plan.decode
        if batched is not None:
            self._attend_decode_batch(batched, q, flat_k, flat_v, out, scale, group, work, k_rows, v_rows)
        for i, ctx_len in enumerate(seq_lens):
            start, end = query_start[i], query_start[i + 1]
            q_len = end - start
            if q_len == 0 or (q_len == 1 and batched is not None):
                continue
            if q_len == 1:
                keys = _read(flat_k, runs[i]).transpose(0, 1)  # [kv_heads, ctx, d]
                values = _read(flat_v, runs[i]).transpose(0, 1)
                query = q[start].view(num_kv_heads, group, head_dim)
                if fp8:
                    query, keys, values = query.to(work) * k_rows, fp8_codes_as(keys, work), fp8_codes_as(values, work)
                attn = F.scaled_dot_product_attention(query, keys, values, scale=scale)
                if fp8:
                    attn = attn * v_rows
                out[start] = attn.view(num_heads, head_dim)
                continue
            query = q[start:end].transpose(0, 1)  # [heads, q_len, d]
            from_cache = ctx_len != q_len
            positions = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
            if not from_cache:
                # Whole sequence in this step: attend over the fresh K/V, plain causal mask (unless a
                # window shorter than the prompt cuts it).
                keys, values, mask = k[start:end], v[start:end], None
                if sliding_window is not None and q_len > sliding_window:
                    mask = attend_mask(positions, positions, sliding_window)
            else:
                keys, values = _read(flat_k, runs[i]), _read(flat_v, runs[i])
                mask = attend_mask(positions, torch.arange(plan.starts[i], ctx_len, device=q.device), sliding_window)
                if fp8:
                    query, keys, values = query.to(work) * k_heads, fp8_codes_as(keys, work), fp8_codes_as(values, work)
            attn = F.scaled_dot_product_attention(
                query,
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=group > 1,
            )
            if fp8 and from_cache:
                attn = attn * v_heads
            out[start:end] = attn.transpose(0, 1)
        return out

    @staticmethod
    def _attend_decode_batch(
        batch: DecodeBatch,
        q: torch.Tensor,
        flat_k: torch.Tensor,
        flat_v: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        group: int,
        work: torch.dtype,
        k_rows: torch.Tensor | None,
        v_rows: torch.Tensor | None,
    ) -> None:
        """Every decode row of the step in one attention call over contexts gathered into
        ``[rows, kv_heads, max_ctx, head_dim]`` (padding masked), instead of one call per row."""
        rows, num_kv_heads, head_dim = batch.rows.numel(), flat_k.shape[1], flat_k.shape[2]
        fp8 = k_rows is not None and v_rows is not None
        if fp8:  # gather the codes as bytes (no float8 gather kernel on every device), widen after
            flat_k, flat_v = flat_k.view(torch.uint8), flat_v.view(torch.uint8)
        keys = flat_k.index_select(0, batch.slots).view(rows, batch.max_ctx, num_kv_heads, head_dim).transpose(1, 2)
        values = flat_v.index_select(0, batch.slots).view(rows, batch.max_ctx, num_kv_heads, head_dim).transpose(1, 2)
        query = (q if batch.all_rows else q.index_select(0, batch.rows)).view(rows, num_kv_heads, group, head_dim)
        if fp8 and k_rows is not None:
            query, keys, values = query.to(work) * k_rows, fp8_codes_as(keys, work), fp8_codes_as(values, work)
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=batch.mask, scale=scale)
        if fp8 and v_rows is not None:
            attn = attn * v_rows
        attn = attn.reshape(rows, -1, head_dim).to(out.dtype)
        if batch.all_rows:
            out.copy_(attn)
        else:
            out.index_copy_(0, batch.rows, attn)


@dataclass
class StepPlan:
    """How one step reads the cache for one window: each sequence's slot runs from ``starts[i]`` on,
    and the batched decode rows (or None)."""

    runs: list[SlotRuns]
    starts: list[int]
    decode: DecodeBatch | None


@dataclass
class _GroupPlans:
    """One KV group's step: its metadata (the step's identity), host block tables, plans per window, and
    whether any of its slots is -1."""

    meta: AttentionMetadata
    tables: list[list[int]]
    plans: dict[int | None, StepPlan]
    skips_slots: bool


# The batched decode path pads every context to the longest; above this much padding per real
# context token the per-sequence loop (views, no copies) reads less memory.
_MAX_PADDING_RATIO = 2.0


@dataclass
class DecodeBatch:
    """The decode rows of one step, planned once for every layer: which flat rows they are, the
    cache slots of each one's context padded to the longest, and the mask that hides the padding."""

    rows: torch.Tensor  # [n] token rows of q/out
    all_rows: bool  # every token row of the step is one of them, in order
    slots: torch.Tensor  # [n * max_ctx] flat cache slots (padding: the row's first slot)
    mask: torch.Tensor  # [n, 1, 1, max_ctx] bool, True where a row may attend
    max_ctx: int

    @classmethod
    def plan(
        cls, runs: list[SlotRuns], seq_lens: list[int], query_start: list[int], device: torch.device
    ) -> DecodeBatch | None:
        """``seq_lens``: how many context slots each sequence's ``runs`` hold (its window's, if any)."""
        decode = [i for i in range(len(seq_lens)) if query_start[i + 1] - query_start[i] == 1]
        if len(decode) < 2:
            return None
        lens = [seq_lens[i] for i in decode]
        max_ctx = max(lens)
        if len(decode) * max_ctx > _MAX_PADDING_RATIO * sum(lens):
            return None
        slots = torch.empty(len(decode), max_ctx, dtype=torch.int64)
        for row, i in enumerate(decode):
            # Padding repeats the row's own first slot: a masked score of a finite key is exactly
            # -inf, where a stray slot could hold NaN (free cache memory) and poison the softmax.
            slots[row] = runs[i][0][0]
            slots[row, : seq_lens[i]] = torch.cat([torch.arange(a, b) for a, b in runs[i]])
        mask = torch.arange(max_ctx)[None, :] < torch.tensor(lens)[:, None]
        token_rows = [query_start[i] for i in decode]
        return cls(
            rows=torch.tensor(token_rows, dtype=torch.int64, device=device),
            all_rows=token_rows == list(range(query_start[-1])),
            slots=slots.view(-1).to(device),
            mask=mask[:, None, None, :].to(device),
            max_ctx=max_ctx,
        )
