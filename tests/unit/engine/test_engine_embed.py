"""Embeddings from the engine (``LLM.embed``): the final normed hidden state pooled over the prompt (last token
or mean), L2-normalized, equal to transformers' ``AutoModel`` hidden states within 1e-4 (fp32 on CPU) on random
models and on the real SmolLM2; never served from the prefix cache; batched with generation without changing it."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.core.request import EngineRequest
from sluicegate.models.smollm2 import fetch_smollm2

from .test_gguf_smollm2 import REPO_MODELS

_HF_MODELS: dict[Path, torch.nn.Module] = {}


def hf_embedding(path: Path, prompt: list[int], pooling: str) -> torch.Tensor:
    """transformers' reference: the last layer's hidden states after the final norm, pooled, L2-normalized."""
    if path not in _HF_MODELS:
        _HF_MODELS[path] = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = _HF_MODELS[path](torch.tensor([prompt])).last_hidden_state[0]
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0)


def _prompts(seed: int, lengths: list[int], vocab_size: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers_hidden_state_pooling(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM], pooling: str
) -> None:
    path = model_dir("llama")
    # A small token budget chunks the long prompts' prefill, so mean pooling sums across steps.
    llm = make_llm(path, dtype="float32", max_num_batched_tokens=64)
    prompts = _prompts(0, [1, 2, 16, 17, 100, 200])
    vectors = llm.embed(prompts, pooling=pooling)
    assert len(vectors) == len(prompts)
    for prompt, vector in zip(prompts, vectors, strict=True):
        got = torch.tensor(vector)
        assert got.shape == (llm.engine.loaded.hf_config.hidden_size,)
        assert abs(got.norm().item() - 1.0) < 1e-5
        torch.testing.assert_close(got, hf_embedding(path, prompt, pooling), atol=1e-4, rtol=0)


def test_embeddings_never_read_or_write_the_prefix_cache(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    path = model_dir("llama")
    llm = make_llm(path, dtype="float32")
    prompt = _prompts(1, [80])[0]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))  # caches the prompt's full blocks
    bm = llm.engine.block_manager
    cached, hits, queried = bm.num_cached_blocks, bm.prefix_hit_tokens, bm.prefix_query_tokens
    assert cached > 0
    first = llm.embed(prompt, pooling="mean")[0]
    assert (bm.prefix_hit_tokens, bm.prefix_query_tokens) == (hits, queried)  # nothing read, nor even looked up
    assert bm.num_cached_blocks == cached  # nothing written
    llm.embed([*prompt, 7], pooling="mean")
    assert bm.num_cached_blocks == cached
    assert llm.embed(prompt, pooling="mean")[0] == first


def test_an_embedding_prompt_may_fill_the_context(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(model_dir("llama"), dtype="float32", max_model_len=64)
    assert len(llm.embed([_prompts(2, [64])[0]])[0]) == llm.engine.loaded.hf_config.hidden_size
    with pytest.raises(ValueError, match="more than max_model_len=64"):
        llm.embed([_prompts(2, [65])[0]])
    with pytest.raises(ValueError, match="unknown pooling 'cls'"):
        llm.embed("hello", pooling="cls")
    with pytest.raises(ValueError, match="one choice"):
        EngineRequest.build("hello", SamplingParams(n=2), pooling="last")


def test_embeddings_batched_with_generation_change_nothing(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    path = model_dir("qwen2")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    gen_prompts = _prompts(3, [5, 40, 90])
    embed_prompts = _prompts(4, [1, 33, 150, 60])
    alone_llm = make_llm(path, dtype="float32")
    alone = [o.token_ids for o in alone_llm.generate(gen_prompts, params)]
    alone_vectors = [alone_llm.embed(p, pooling="mean")[0] for p in embed_prompts]

    llm = make_llm(path, dtype="float32", max_num_batched_tokens=96)
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in gen_prompts[:2]]
    engine.step()  # the generations are under way (one decoding) when the embeddings arrive
    ids += [engine.add_request(p, pooling="mean") for p in embed_prompts]
    ids.append(engine.add_request(gen_prompts[2], params))
    finals = {}
    mixed_steps = 0
    while engine.has_unfinished():
        running = engine.scheduler.running
        if any(s.pooling for s in running) and any(not s.pooling for s in running):
            mixed_steps += 1
        for delta in engine.step():
            if delta.finished:
                assert delta.final is not None
                finals[delta.request_id] = delta.final
    assert mixed_steps > 0
    assert [finals[i].token_ids for i in ids[:2] + ids[-1:]] == alone
    for rid, vector in zip(ids[2:-1], alone_vectors, strict=True):
        out = finals[rid]
        assert out.token_ids == [] and out.finish_reason == "stop" and out.embedding is not None
        torch.testing.assert_close(torch.tensor(out.embedding), torch.tensor(vector), atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_smollm2_embeddings_equal_transformers(make_llm: Callable[..., LLM], pooling: str) -> None:
    llm = make_llm(fetch_smollm2(REPO_MODELS), dtype="float32", max_model_len=1024, num_kv_blocks=64)
    texts = ["The capital of France is Paris.", "Embeddings map text to vectors; " * 12, "hi"]
    vectors = llm.embed(texts, pooling=pooling)
    for text, vector in zip(texts, vectors, strict=True):
        ids = llm.tokenizer(text).input_ids
        want = hf_embedding(llm.engine.loaded.path, ids, pooling)
        torch.testing.assert_close(torch.tensor(vector), want, atol=1e-4, rtol=0)
