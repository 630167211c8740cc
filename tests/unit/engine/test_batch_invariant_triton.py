"""The deterministic mode's GPU kernels (execution/batch_invariant_triton.py), rehearsed on the CPU under Triton's
interpreter (compiled on a GPU where there is one): a row's result is the same bits whatever the batch around it,
and a prefill of N tokens gives the attention of N decode steps, across chunking and the fixed KV split."""

from __future__ import annotations

# ruff: noqa: E402 - the imports below follow require_import (tests/needs.py), a CI-aware importorskip
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from needs import require_import, require_triton_interpreter

require_import("triton", "a dependency of torch; pip install -e '.[dev]'")

from gpu_workers.engine import LLM, RequestOutput, SamplingParams
from gpu_workers.engine.attention import triton_kernels as tk
from gpu_workers.engine.attention.metadata import AttentionMetadata
from gpu_workers.engine.config import EngineConfig
from gpu_workers.engine.execution.batch_invariant_triton import (
    invariant_matmul,
    invariant_paged_attention,
    invariant_rms_norm,
    make_batch_invariant_cuda,
)

DEVICE = "cuda" if torch.cuda.is_available() and not tk.INTERPRETED else "cpu"
BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 32
SPLIT = 64  # tokens per KV segment in these checks: contexts below span 1 to 4 segments


@pytest.fixture(autouse=True)
def _kernels_run() -> None:
    if DEVICE == "cpu":
        require_triton_interpreter(tk.INTERPRETED)


def _distinct(f: Callable[[torch.Tensor], torch.Tensor], k: int, dtype: torch.dtype, sizes: tuple[int, ...]) -> int:
    """How many different results one row gets, placed first, in the middle and last of batches of ``sizes`` rows."""
    gen = torch.Generator().manual_seed(0)
    row = torch.randn(k, generator=gen)
    outs = []
    for m in sizes:
        for place in sorted({0, m // 2, m - 1}):
            x = torch.randn(m, k, generator=gen)
            x[place] = row
            outs.append(f(x.to(dtype).to(DEVICE))[place].float().cpu())
    return len({tuple(o.tolist()) for o in outs})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_matmul_gives_a_row_the_same_bits_in_any_batch_and_matches_linear(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(80, 200, generator=gen).to(dtype).to(DEVICE)  # N and K not multiples of the tile
    bias = torch.randn(80, generator=gen).to(dtype).to(DEVICE)
    assert _distinct(lambda x: invariant_matmul(x, weight, bias), 200, dtype, (1, 2, 7, 64, 65, 130)) == 1
    x = torch.randn(3, 5, 200, generator=gen).to(dtype).to(DEVICE)
    got, want = invariant_matmul(x, weight, bias), F.linear(x, weight, bias)
    assert got.shape == want.shape == (3, 5, 80)
    tolerance = {} if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(got.float(), want.float(), **tolerance)
    with pytest.raises(ValueError, match="weight"):
        invariant_matmul(x, weight[:, :100])


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_the_rms_norm_gives_a_row_the_same_bits_in_any_batch_and_matches_the_models(gemma: bool) -> None:
    from gpu_workers.engine.models.gemma3 import GemmaRMSNorm
    from gpu_workers.engine.models.llama import RMSNorm

    norm = (GemmaRMSNorm if gemma else RMSNorm)(96, 1e-6).to(torch.bfloat16)
    torch.nn.init.normal_(norm.weight)
    norm = norm.to(DEVICE)
    f = lambda x: invariant_rms_norm(x, norm.weight, norm.eps, weight_offset=gemma)  # noqa: E731
    assert _distinct(f, 96, torch.bfloat16, (1, 2, 9, 100)) == 1
    x = torch.randn(4, 96).to(torch.bfloat16).to(DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(f(x), norm(x), atol=0.02, rtol=0.01)


class _Cache:
    """Random K/V for a few sequences scattered into a NaN-filled paged cache (a wrong slot read poisons the
    result), and queries for every position of every sequence."""

    def __init__(self, lengths: list[int], dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(2)
        blocks = [math.ceil(n / BLOCK) for n in lengths]
        pool = torch.randperm(sum(blocks) + 2, generator=gen).tolist()
        shape = (sum(blocks) + 2, BLOCK, KV_HEADS, HEAD_DIM)
        self.k = torch.full(shape, float("nan"), dtype=dtype)
        self.v = torch.full(shape, float("nan"), dtype=dtype)
        self.tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
        self.q = []
        for i, n in enumerate(lengths):
            own = [pool.pop() for _ in range(blocks[i])]
            self.tables[i, : len(own)] = torch.tensor(own, dtype=torch.int32)
            slots = torch.tensor([own[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
            self.k.view(-1, KV_HEADS, HEAD_DIM)[slots] = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
            self.v.view(-1, KV_HEADS, HEAD_DIM)[slots] = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
            self.q.append(torch.randn(n, HEADS, HEAD_DIM, generator=gen).to(dtype))
        self.k, self.v = self.k.to(DEVICE), self.v.to(DEVICE)

    def attend(self, rows: list[tuple[int, int, int]], window: int | None = None, plain: bool = False) -> torch.Tensor:
        """One step: ``(sequence, first query position, query count)`` per row; the context ends at the last."""
        q = torch.cat([self.q[s][p : p + n] for s, p, n in rows]).to(DEVICE)
        starts = [0]
        for _, _, n in rows:
            starts.append(starts[-1] + n)
        lens = [p + n for _, p, n in rows]
        meta = AttentionMetadata(
            slot_mapping=torch.full((q.shape[0],), -1, dtype=torch.int64, device=DEVICE),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
            block_tables=self.tables[[s for s, _, _ in rows]].to(DEVICE),
            max_query_len=max(n for _, _, n in rows),
            max_seq_len=max(lens),
        )
        if plain:
            return tk.paged_attention(q, self.k, self.v, meta, HEAD_DIM**-0.5, sliding_window=window).cpu()
        return invariant_paged_attention(
            q, self.k, self.v, meta, HEAD_DIM**-0.5, split_tokens=SPLIT, sliding_window=window
        ).cpu()


@pytest.mark.slow  # the interpreter: 10-40 s each on the shared 2-core box
@pytest.mark.parametrize("window", [None, 40], ids=["full", "sliding"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_of_a_token_is_the_same_bits_in_any_batch_chunk_or_decode_step(
    dtype: torch.dtype, window: int | None
) -> None:
    cache = _Cache([150, 210, 20], dtype)
    positions = [0, 1, 63, 64, 65, 127, 128, 149]
    # Decode steps, each token alone: the reference bits.
    alone = {p: cache.attend([(0, p, 1)], window)[0] for p in positions}
    # The whole prompt prefilled in one step, beside a longer sequence (one more KV segment) and a short one.
    crowd = cache.attend([(1, 190, 20), (0, 0, 150), (2, 19, 1)], window)[20 : 20 + 150]
    # Chunked: positions 50..149 in one chunk after a prefix-cache hit on the first 50.
    chunk = cache.attend([(2, 0, 20), (0, 50, 100)], window)[20:]
    # A decode batch: the token among other decodes.
    decodes = cache.attend([(1, 209, 1), (0, 149, 1), (2, 10, 1)], window)[1]
    for p in positions:
        assert torch.equal(crowd[p], alone[p]), f"prefill in a crowd differs at position {p}"
        if p >= 50:
            assert torch.equal(chunk[p - 50], alone[p]), f"chunked prefill differs at position {p}"
    assert torch.equal(decodes, alone[149])
    # And it is attention: the plain kernel's result to rounding.
    plain = cache.attend([(1, 190, 20), (0, 0, 150), (2, 19, 1)], window, plain=True)[20 : 20 + 150]
    tolerance = dict(atol=2e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(crowd.float(), plain.float(), **tolerance)


def test_the_plain_kernel_is_not_batch_invariant_where_the_mode_is() -> None:
    """What the mode is for: without it a prefill's token is not a decode step's (another tile, another sum)."""
    cache = _Cache([150], torch.float32)
    crowd = cache.attend([(0, 0, 150)], plain=True)
    differ = sum(not torch.equal(crowd[p], cache.attend([(0, p, 1)], plain=True)[0]) for p in range(70, 150, 8))
    assert differ > 0


def test_the_mode_runs_on_cuda_with_the_triton_backend_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the config's checks only; nothing runs
    config = EngineConfig(model="m", device="cuda", deterministic=True)
    assert config.attention_backend == "triton" and not config.enable_cascade_attention
    with pytest.raises(ValueError, match="triton attention backend"):
        EngineConfig(model="m", device="cuda", deterministic=True, attention_backend="torch")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model="m", device="cuda", deterministic=True, quantization="fp8")
    with pytest.raises(ValueError, match="split_tokens"):
        invariant_paged_attention(
            torch.zeros(1, HEADS, HEAD_DIM), torch.zeros(1, BLOCK, KV_HEADS, HEAD_DIM),
            torch.zeros(1, BLOCK, KV_HEADS, HEAD_DIM), _meta_one(), 1.0, split_tokens=100,
        )  # fmt: skip


def test_switching_a_model_refuses_what_the_kernels_do_not_cover() -> None:
    from gpu_workers.engine.attention.torch_backend import TorchAttentionBackend
    from gpu_workers.engine.attention.triton_backend import TritonAttentionBackend
    from gpu_workers.engine.models.moe import MoEExperts

    linear = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match="triton attention backend"):
        make_batch_invariant_cuda(linear, TorchAttentionBackend())
    backend = TritonAttentionBackend()
    with pytest.raises(ValueError, match="mixture-of-experts"):
        make_batch_invariant_cuda(torch.nn.Sequential(torch.nn.Linear(8, 8), MoEExperts(2, 8, 4)), backend)
    assert not backend.batch_invariant
    assert make_batch_invariant_cuda(linear, backend) == 1 and backend.attention is invariant_paged_attention


def _meta_one() -> AttentionMetadata:
    one = torch.ones(1, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.zeros(1, dtype=torch.int64),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=one,
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        max_query_len=1,
        max_seq_len=1,
    )


@pytest.mark.slow  # the whole model on interpreted kernels: about a minute on the shared 2-core box
def test_an_engine_on_the_modes_kernels_answers_alone_as_in_a_crowd(
    make_llm: Callable[..., LLM], model_dir: Callable[[str], Path]
) -> None:
    """The engine with its linears, norms and attention on this module's kernels: prompts alone equal the same
    prompts twice at once, chunked 16 tokens a step (a CUDA engine switches itself in the mode; the interpreted
    rehearsal switches the model the same way, since the CPU mode runs the torch path)."""
    model = model_dir("llama")
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((3, 17, 30, 41))]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)

    def switched(**kwargs: Any) -> LLM:
        on_cuda = DEVICE == "cuda"
        llm = make_llm(model, device=DEVICE, attention_backend="triton", dtype="float32", deterministic=on_cuda,
                       enable_cascade_attention=False, **kwargs)  # fmt: skip
        if not on_cuda:
            assert make_batch_invariant_cuda(llm.engine.loaded.model, llm.engine.runner.backend) > 0
        return llm

    def answer(out: RequestOutput) -> tuple[list[int], list[float]]:
        return out.token_ids, [lp.logprob for lp in out.logprobs or []]

    alone_llm = switched()
    alone = [answer(alone_llm.generate([p], params)[0]) for p in prompts]
    together = switched(max_num_batched_tokens=16).generate(prompts + prompts, params)
    assert [answer(out) for out in together] == alone + alone
