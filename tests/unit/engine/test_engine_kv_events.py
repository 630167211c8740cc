"""The engine's KV events: the blocks it caches and evicts, journaled per step for a fleet router, and a snapshot
of what it holds; and the hashes a router computes for a prompt (through the tokenizer the worker publishes and
``sluicegate.block_hashes``) are the ones the engine caches that prompt under."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.worker.heartbeat import model_tokenizer
from gpu_workers.worker.prompts import prompt_token_ids
from schemas import ChatMessage, InferenceRequest, ModelTokenizer
from sluicegate.api.prompt_tokens import ModelTokenizerView
from sluicegate.block_hashes import chain_seed, prompt_block_hashes

BLOCK = 4
GREEDY = SamplingParams(max_tokens=3, temperature=0.0)


def _llm(make_llm: Callable[..., LLM], path: Path, **kwargs: object) -> LLM:
    return make_llm(path, block_size=BLOCK, enable_kv_events=True, **kwargs)


def test_events_name_the_blocks_cached_with_their_parents(make_llm: Callable[..., LLM], model_dir) -> None:
    llm = _llm(make_llm, model_dir("llama"))
    prompt = list(range(3, 3 + 4 * BLOCK + 1))  # four full blocks before the last token
    llm.generate([prompt], GREEDY)
    events = llm.engine.take_kv_events()
    assert events is not None and not events.snapshot and events.block_size == BLOCK
    hashes = prompt_block_hashes(prompt, BLOCK)
    assert [h for h, _ in events.stored][:4] == hashes
    assert [p for _, p in events.stored][:4] == [chain_seed(0), *hashes[:3]]
    assert events.removed == []
    assert llm.engine.take_kv_events() is None  # drained
    snapshot = llm.engine.kv_snapshot()
    assert snapshot.snapshot and set(hashes) <= {h for h, _ in snapshot.stored}


def test_evictions_are_journaled(make_llm: Callable[..., LLM], model_dir) -> None:
    llm = _llm(make_llm, model_dir("llama"), num_kv_blocks=16, max_model_len=48)
    first = list(range(3, 3 + 40))
    llm.generate([first], GREEDY)
    stored = {h for h, _ in llm.engine.take_kv_events().stored}
    llm.generate([list(range(100, 140))], GREEDY)  # a different prompt that needs the pool back
    events = llm.engine.take_kv_events()
    assert events is not None and events.removed
    assert set(events.removed) <= stored


def test_events_are_off_by_default(make_llm: Callable[..., LLM], model_dir) -> None:
    llm = make_llm(model_dir("llama"), block_size=BLOCK)
    llm.generate([list(range(3, 30))], GREEDY)
    assert llm.engine.take_kv_events() is None
    assert llm.engine.kv_snapshot().stored == []


def test_the_router_hashes_a_chat_prompt_as_the_engine_caches_it(make_llm: Callable[..., LLM], model_dir) -> None:
    """Real token ids: the chat template and tokenizer as the worker publishes them, rendered and encoded the way
    ingress and the Kafka-native router do, then chained by the shared hash module."""
    llm = _llm(make_llm, model_dir("llama"))
    request = InferenceRequest(
        request_id="r1",
        model="m",
        messages=[
            ChatMessage(role="system", content="You are a helpful assistant who answers briefly and kindly."),
            ChatMessage(role="user", content="What is the capital of France? Please answer in one sentence."),
        ],
    )
    worker_ids = prompt_token_ids(request, llm.tokenizer)
    published = model_tokenizer("m", llm.tokenizer, None)
    assert published is not None
    router_ids = ModelTokenizerView(ModelTokenizer.model_validate_json(published)).encode_request(request)
    assert router_ids == worker_ids
    llm.generate([worker_ids], GREEDY)
    engine_hashes = [h for h, _ in llm.engine.take_kv_events().stored]
    router_hashes = prompt_block_hashes(router_ids, BLOCK)
    assert len(router_hashes) >= 4
    assert engine_hashes[: len(router_hashes)] == router_hashes
