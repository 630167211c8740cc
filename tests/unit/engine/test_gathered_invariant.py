"""The deterministic mode's compiled attention (attention/gathered_invariant.py) and the rows it is given
(execution/invariant_rows.py): a row's output, bit for bit, does not depend on the rows beside it, the step's widest
table, or whether its keys are this step's or the cache's; and a step is cut into rows that say so."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from gpu_workers.engine.attention.gathered_invariant import attend_rows_invariant
from gpu_workers.engine.attention.metadata import AttentionMetadata
from gpu_workers.engine.execution.cpu_decode_compile import cxx_compiler
from gpu_workers.engine.execution.invariant_rows import token_rows

BLOCK, KV_HEADS, GROUP, HEAD_DIM, BLOCKS = 16, 3, 3, 64, 48
Attend = Callable[..., torch.Tensor]


def _rand(*shape: int, gen: torch.Generator) -> torch.Tensor:
    # float32, not the cache's usual bfloat16: the output then keeps every bit of the arithmetic, where bfloat16's
    # rounding would hide most differences (they are one or two units in float32's last place).
    return torch.randn(*shape, generator=gen)


@pytest.fixture(scope="module")
def cache() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return _rand(BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, gen=gen), _rand(BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, gen=gen)


@pytest.fixture(scope="module")
def attend() -> Attend:
    """Compiled, as the engine only runs it: the promise is the compiled graph's, whose one loop nest serves every
    row count (run eagerly, torch's reductions pick their strategy by shape, and a row can differ in its last bit)."""
    if cxx_compiler() is None:
        pytest.skip("needs a C++ compiler for Inductor (apt-get install g++)")
    return torch.compile(attend_rows_invariant, dynamic=True, fullgraph=True)  # type: ignore[return-value]


def _run(
    attend: Attend,
    cache: tuple[torch.Tensor, torch.Tensor],
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], int, int]],
) -> torch.Tensor:
    """Rows of (q, k, v, block table, position, fresh_from), tables padded to the widest."""
    width = max(len(r[3]) for r in rows)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(rows), dtype=torch.int64),
        query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32),
        seq_lens=torch.tensor([r[4] + 1 for r in rows], dtype=torch.int32),
        block_tables=torch.tensor([r[3] + [0] * (width - len(r[3])) for r in rows], dtype=torch.int32),
        max_query_len=1,
        max_seq_len=max(r[4] + 1 for r in rows),
        fresh_from=torch.tensor([r[5] for r in rows]),
        new_kv=[],
    )
    q, k, v = (torch.stack([r[i] for r in rows]) for i in range(3))
    return attend(q, k, v, cache[0], cache[1], meta, HEAD_DIM**-0.5)


def test_a_row_attends_the_same_beside_any_rows_and_tables(
    attend: Attend, cache: tuple[torch.Tensor, torch.Tensor]
) -> None:
    gen, rng = torch.Generator().manual_seed(5), random.Random(5)
    for length in (1, 17, 57, 130, 300):
        table = rng.sample(range(1, BLOCKS), -(-length // BLOCK))
        q = _rand(KV_HEADS * GROUP, HEAD_DIM, gen=gen)
        k, v = _rand(KV_HEADS, HEAD_DIM, gen=gen), _rand(KV_HEADS, HEAD_DIM, gen=gen)
        row = (q, k, v, table, length - 1, length - 1)
        alone = _run(attend, cache, [row])[0]
        # The reference: plain attention over the cached keys and the row's own.
        keys = torch.cat([cache[0][b] for b in table])[: length - 1]
        values = torch.cat([cache[1][b] for b in table])[: length - 1]
        keys, values = torch.cat([keys, k[None]]).float(), torch.cat([values, v[None]]).float()
        expected = F.scaled_dot_product_attention(
            q.float().view(KV_HEADS, GROUP, HEAD_DIM), keys.transpose(0, 1), values.transpose(0, 1)
        ).reshape(KV_HEADS * GROUP, HEAD_DIM)
        torch.testing.assert_close(alone.float(), expected, atol=2e-2, rtol=2e-2)
        # Beside 1 to 12 rows (a BLAS changes kernel there) of other lengths, some with wider tables.
        for others in (1, 2, 3, 5, 8, 12):
            company = []
            for _ in range(others):
                n = rng.randrange(1, 400)
                company.append(
                    (_rand(KV_HEADS * GROUP, HEAD_DIM, gen=gen), _rand(KV_HEADS, HEAD_DIM, gen=gen),
                     _rand(KV_HEADS, HEAD_DIM, gen=gen), rng.sample(range(1, BLOCKS), -(-n // BLOCK)), n - 1, n - 1)
                )  # fmt: skip
            at = rng.randrange(others + 1)
            out = _run(attend, cache, [*company[:at], row, *company[at:]])[at]
            assert torch.equal(out, alone), (length, others)


def test_a_prompt_token_attends_as_its_decode_step(attend: Attend, cache: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The last of ``n`` prompt tokens, its earlier ones' keys this step's, equals the same token decoded with
    every key in the cache."""
    gen = torch.Generator().manual_seed(9)
    k_cache, v_cache = cache[0].clone(), cache[1].clone()
    table, start, n = [7, 8, 9], 20, 13
    rows = []
    for position in range(start, start + n):
        k, v = _rand(KV_HEADS, HEAD_DIM, gen=gen), _rand(KV_HEADS, HEAD_DIM, gen=gen)
        rows.append((_rand(KV_HEADS * GROUP, HEAD_DIM, gen=gen), k, v, table, position, start))
    prompt = _run(attend, (k_cache, v_cache), rows)
    for _, k, v, _, position, _ in rows:  # store them, as the step would after its graph
        k_cache[table[position // BLOCK], position % BLOCK] = k
        v_cache[table[position // BLOCK], position % BLOCK] = v
    for i, (q, k, v, _, position, _) in enumerate(rows):
        decoded = _run(attend, (k_cache, v_cache), [(q, k, v, table, position, position)])[0]
        assert torch.equal(decoded, prompt[i]), position


def test_a_step_is_cut_into_rows_that_know_their_fresh_keys() -> None:
    """A decode row (position 30) and a 7-token prompt chunk (positions 10..16), at most 4 rows a batch."""
    meta = AttentionMetadata(
        slot_mapping=torch.arange(100, 108),
        query_start_loc=torch.tensor([0, 1, 8], dtype=torch.int32),
        seq_lens=torch.tensor([31, 17], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
        max_query_len=7,
        max_seq_len=31,
    )
    input_ids, positions = torch.arange(50, 58), torch.tensor([30, *range(10, 17)])
    batches = list(token_rows(input_ids, positions, meta, max_rows=4))
    assert [b.input_ids.tolist() for b in batches] == [[50, 51, 52, 53], [54, 55, 56, 57]]
    assert [b.meta.seq_lens.tolist() for b in batches] == [[31, 11, 12, 13], [14, 15, 16, 17]]
    # Keys of the prompt before a batch were stored by the batch before it: its fresh keys start at its first row.
    assert [b.meta.fresh_from.tolist() for b in batches if b.meta.fresh_from is not None] == [
        [30, 10, 10, 10],
        [13, 13, 13, 13],
    ]
    assert batches[0].meta.block_tables.tolist() == [[1, 2], [3, 0], [3, 0], [3, 0]]
    assert torch.cat([b.meta.slot_mapping for b in batches]).tolist() == list(range(100, 108))
    assert all(b.meta.max_query_len == 1 and b.meta.query_start_loc.tolist() == list(range(5)) for b in batches)
