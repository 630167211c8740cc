"""Decode CUDA graphs: bucket sizes, static-buffer padding, when graphs are used, and (on a GPU)
that replaying graphs gives exactly the tokens of eager execution."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gpu_workers.engine import LLM, EngineConfig, SamplingParams
from gpu_workers.engine.execution.cuda_graphs import (
    DecodeGraphRunner,
    DecodeRows,
    StaticDecodeBuffers,
    bucket_for,
    graph_batch_sizes,
)

from .conftest import HFReference


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_graph_batch_sizes_and_buckets() -> None:
    assert graph_batch_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    sizes = graph_batch_sizes(40)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 33, 40)] == [1, 2, 4, 8, 8, 16, 32, 40, 40]
    assert bucket_for(41, sizes) is None
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_batch_sizes(0)
    with pytest.raises(ValueError, match="at least one"):
        bucket_for(0, sizes)


def test_static_buffers_pad_rows_so_they_store_nothing() -> None:
    buf = StaticDecodeBuffers(max_batch=8, max_blocks_per_seq=6, block_size=16, device=torch.device("cpu"))
    # An earlier, wider step leaves stale block ids behind; they stay valid ids and are never read.
    buf.block_tables.fill_(9)
    rows = DecodeRows(
        input_ids=[11, 12, 13],
        positions=[40, 5, 17],
        slots=[3 * 16 + 8, 7 * 16 + 5, 2 * 16 + 1],
        seq_lens=[41, 6, 18],
        block_tables=[[1, 2, 3], [7], [4, 2]],
        common_prefix_len=32,
    )
    buf.load(rows, batch_size=4)
    assert buf.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buf.positions[:4].tolist() == [40, 5, 17, 0]
    assert buf.slot_mapping[:4].tolist() == [56, 117, 33, -1]
    assert buf.seq_lens[:4].tolist() == [41, 6, 18, 1]
    assert buf.prefix_len.tolist() == [32]
    assert buf.block_tables[:3, :3].tolist() == [[1, 2, 3], [7, 0, 0], [4, 2, 0]]
    assert bool((buf.block_tables[3:] == 9).all()) and bool((buf.block_tables[:, 3:] == 9).all())

    meta = buf.metadata(4, max_seq_len=96, cascade=True)
    assert meta.num_seqs == 4 and meta.is_decode_only and meta.max_query_len == 1
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.common_prefix_len == 16 and meta.common_prefix_len_device is buf.prefix_len
    plain = buf.metadata(2, max_seq_len=96, cascade=False)
    assert plain.common_prefix_len == 0 and plain.common_prefix_len_device is None
    # A smaller batch later: the tail rows that were real before become padding.
    buf.load(DecodeRows([5], [0], [16], [1], [[1]]), batch_size=2)
    assert buf.slot_mapping[:2].tolist() == [16, -1] and buf.seq_lens[:2].tolist() == [1, 1]
    assert buf.prefix_len.tolist() == [0]

    with pytest.raises(ValueError, match="cannot load 3 rows into a batch of 2"):
        buf.load(rows, batch_size=2)
    with pytest.raises(ValueError, match="exceeds the static width"):
        buf.load(DecodeRows([1], [0], [0], [1], [list(range(7))]), batch_size=1)


def test_static_buffers_carry_lora_slots_with_padding_rows_on_the_base_model() -> None:
    buf = StaticDecodeBuffers(max_batch=8, max_blocks_per_seq=4, block_size=16, device=torch.device("cpu"), lora=True)
    assert buf.lora_slots is not None
    rows = DecodeRows([1, 2, 3], [0, 0, 0], [0, 16, 32], [1, 1, 1], [[0], [1], [2]], lora_slots=[2, -1, 0])
    buf.load(rows, batch_size=4)
    assert buf.lora_slots[:4].tolist() == [2, -1, 0, -1]
    batch = buf.lora_batch(4)
    assert batch.slots_on_device and batch.num_tokens == 4 and batch.num_segments == 4
    assert batch.seg_starts.tolist() == [0, 1, 2, 3] and batch.seg_lens.tolist() == [1, 1, 1, 1]
    # The batch reads the buffer itself: the next step's slots show through the same batch object.
    buf.load(DecodeRows([1, 2], [1, 1], [1, 17], [2, 2], [[0], [1]]), batch_size=2)
    assert batch.seg_slots.tolist() == [-1, -1, 0, -1] and buf.lora_slots[:2].tolist() == [-1, -1]
    plain = StaticDecodeBuffers(max_batch=4, max_blocks_per_seq=4, block_size=16, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="without them"):
        plain.load(rows, batch_size=4)
    with pytest.raises(RuntimeError, match="without LoRA slots"):
        plain.lora_batch(2)


def test_graphs_need_cuda_and_are_off_on_cpu(model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]) -> None:
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphRunner(lambda *a: a[0], [1, 2], 64, 16, torch.device("cpu"), cascade=False, capture=True)
    llm = make_llm(model_dir("llama"))
    runner = llm.engine.runner
    assert runner.decode_graphs is None
    config = llm.engine.config
    assert config.enforce_eager is False
    assert "not a CUDA device" in (runner.decode_graphs_unsupported(config) or "")
    eager = EngineConfig(model=config.model, enforce_eager=True)
    assert runner.decode_graphs_unsupported(eager) == "enforce_eager=True"
    with pytest.raises(ValueError, match="enforce_eager must be a bool"):
        EngineConfig(model=config.model, enforce_eager="no")  # type: ignore[arg-type]


def test_padded_decode_path_on_torch_backend_matches_transformers(
    model_dir: Callable[[str], Path], hf_reference: HFReference, make_llm: Callable[..., LLM]
) -> None:
    # The graph path's inputs (buckets 1/2/4/8/16/20, padding rows), run eagerly with the
    # reference backend: batches of 1..9 sequences as requests finish at different lengths.
    path = model_dir("llama")
    llm = make_llm(path)
    llm.engine.runner.enable_decode_graphs(max_num_seqs=20, max_model_len=llm.engine.max_model_len, capture=False)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 40))] for _ in range(9)]
    max_tokens = [rng.randint(1, 12) for _ in prompts]
    outputs = llm.generate(prompts, [_greedy(n) for n in max_tokens])
    for out, prompt, n in zip(outputs, prompts, max_tokens, strict=True):
        assert out.token_ids == hf_reference.greedy(path, prompt, n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_gives_the_eager_tokens(model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]) -> None:
    path = model_dir("llama3_tied")
    rng = random.Random(7)
    shared = [rng.randrange(3, 512) for _ in range(300)]
    # Five requests on a shared 300-token prefix (decoded with cascade graphs), then those plus
    # six lone prompts: odd batch sizes (padding rows) and batches without a shared prefix.
    on_prefix = [shared + [rng.randrange(3, 512) for _ in range(rng.randint(1, 30))] for _ in range(5)]
    lone = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 200))] for _ in range(6)]
    batches = [on_prefix, on_prefix + lone]
    max_tokens = [rng.randint(8, 40) for _ in on_prefix + lone]
    results = {}
    for eager in (True, False):
        # fp32: padded GEMM shapes and split-KV counts differ between the two paths, and only
        # rounding far below a logit gap keeps greedy tokens identical on a random model.
        llm = make_llm(path, device="cuda", dtype="float32", attention_backend="triton", enforce_eager=eager)
        llm.generate([[*shared, 5]], _greedy(1))  # the prefix is cached before the batches arrive
        tokens = []
        for batch in batches:
            outputs = llm.generate(batch, [_greedy(n) for n in max_tokens[: len(batch)]])
            tokens.append([o.token_ids for o in outputs])
        results[eager] = tokens
        graphs = llm.engine.runner.decode_graphs
        if eager:
            assert graphs is None
        else:
            assert graphs is not None and graphs.num_replays > 0
    assert results[False] == results[True]
