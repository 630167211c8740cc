"""LoRA adapters on the real pipeline: a worker started with ``SLUICEGATE_WORKER_LORAS`` serves the
adapter under its own model name; a streamed chat completion naming it gives exactly the tokens of
``LLM.generate(..., lora_request=...)``; an adapter loaded at run time through ``/v1/load_lora_adapter`` with the
official ``openai`` SDK is checked by the worker's engine (a corrupt one, one of another base model and one above
the rank limit are refused with the engine's one-line reason), served, and gone after its unload; and ``kill -9``
of the worker generating an adapter request mid-stream is a pause: another worker (which loads the adapter from the
registry on demand) continues it with the adapter, every token once, the uninterrupted text.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from needs import require_import

from benchmarks.lora import make_adapter
from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.lora.request import LoRARequest
from gpu_workers.engine.models.random_checkpoint import make_tiny_model
from gpu_workers.worker.prompts import prompt_token_ids
from schemas import ChatMessage, InferenceRequest, TokenEvent

from .conftest import API_KEY, Pipeline

require_import("peft")
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(400)]

ADAPTER = "sql-tuned"
PROMPT = "Once upon a time in a land far away"
MESSAGES = [{"role": "system", "content": "Answer in SQL."}, {"role": "user", "content": "Count the users."}]
CHAT_TOKENS = 40
KILL_TOKENS = 300
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tiny_model_dir(paced_model_dir: Path) -> Path:
    """Generation must last long enough to kill a worker in the middle of it."""
    return paced_model_dir


def peft_adapter(base: Path, out: Path, rank: int, targets: list[str], seed: int) -> Path:
    """A PEFT LoRA adapter of ``base`` with random non-zero A and B (std 0.1), made with ``peft``."""
    return make_adapter(base, out, rank, targets=targets, seed=seed, std=0.1)


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The worker's named adapter: rank 8, every projection."""
    return peft_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora") / ADAPTER, 8, TARGETS, seed=11)


@pytest.fixture(scope="module")
def pipeline_env(adapter_dir: Path) -> dict[str, str]:
    # One intra-op thread per worker: several processes share two cores. The pipeline's first worker registers
    # and preloads the adapter; a second worker (started by the kill test) only has LoRA on.
    return {
        "OMP_NUM_THREADS": "1",
        "SLUICEGATE_WORKER_LORAS": json.dumps({ADAPTER: str(adapter_dir)}),
        "SLUICEGATE_MAX_LORA_RANK": "8",
        "SLUICEGATE_ADMIN_API_KEYS": API_KEY,  # the pipeline's key may load and unload adapters
    }


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[LLM]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(model=str(tiny_model_dir), device="cpu", enable_lora=True, max_lora_rank=8)
    finally:
        torch.set_num_threads(threads)


def generate(llm: LLM, prompt: list[int], max_tokens: int, lora: LoRARequest | None) -> tuple[list[int], str]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([prompt], params, lora_request=lora)[0]
    return list(out.token_ids), out.text


def wait_adapter_advertised(pipeline: Pipeline, worker: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beat = pipeline.heartbeats().get(worker)
        if beat is not None and ADAPTER in beat.adapters and beat.partitions:
            return
        time.sleep(0.2)
    raise AssertionError(f"{worker} never advertised {ADAPTER}: {pipeline.heartbeats()}")


def wait_partitions_split(pipeline: Pipeline, workers: tuple[str, ...], timeout_s: float = 240) -> None:
    """Until each worker heartbeats its share of the model's partitions after the rebalance (no stale claims)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beats = pipeline.heartbeats()
        claims = [(r.topic, r.partition) for w in workers if w in beats for r in beats[w].partitions]
        if all(w in beats and beats[w].partitions for w in workers) and len(claims) == len(set(claims)) == 6:
            return
        time.sleep(0.2)
    raise AssertionError(f"partitions not split between {workers}: {pipeline.heartbeats()}")


def test_a_streamed_chat_naming_the_adapter_gives_the_engines_lora_tokens(
    pipeline: Pipeline, llm: LLM, adapter_dir: Path
) -> None:
    wait_adapter_advertised(pipeline, "worker-a")
    request = InferenceRequest(
        request_id="ref",
        model=pipeline.model,
        messages=[ChatMessage(**m) for m in MESSAGES],  # type: ignore[arg-type]
    )
    prompt = prompt_token_ids(request, llm.tokenizer)
    lora_ids, lora_text = generate(llm, prompt, CHAT_TOKENS, LoRARequest(ADAPTER, 1, str(adapter_dir)))
    base_ids, _ = generate(llm, prompt, CHAT_TOKENS, None)
    assert lora_ids != base_ids, "the adapter must change the output for this test to mean anything"

    client = pipeline.openai()
    assert ADAPTER in {m.id for m in client.models.list().data}
    stream = client.chat.completions.create(
        model=ADAPTER,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=CHAT_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert {c.model for c in chunks} == {ADAPTER}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == lora_text
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == CHAT_TOKENS and usage.prompt_tokens == len(prompt)


def test_adapters_load_and_unload_at_run_time_through_the_openai_sdk(
    pipeline: Pipeline, llm: LLM, tiny_model_dir: Path, tmp_path: Path
) -> None:
    wait_adapter_advertised(pipeline, "worker-a")
    client = pipeline.openai()
    good = peft_adapter(tiny_model_dir, tmp_path / "run-time", 4, ["q_proj", "v_proj"], seed=5)
    too_big = peft_adapter(tiny_model_dir, tmp_path / "rank-16", 16, ["q_proj"], seed=6)
    other_base = make_tiny_model(tmp_path / "other-base", arch="llama", num_layers=2, hidden_size=96)
    foreign = peft_adapter(other_base, tmp_path / "foreign", 4, ["q_proj", "v_proj"], seed=7)
    corrupt = peft_adapter(tiny_model_dir, tmp_path / "corrupt", 4, ["q_proj"], seed=8)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    def load(name: str, path: Path) -> httpx.Response:
        body = {"lora_name": name, "lora_path": str(path)}
        return client.post("/load_lora_adapter", body=body, cast_to=httpx.Response)

    for name, path, words in (
        ("rank-16", too_big, "r=16 exceeds max_lora_rank=8"),
        ("foreign", foreign, "other dimensions"),
        ("corrupt", corrupt, "corrupt"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            load(name, path)
        message = refused.value.body["message"]  # type: ignore[index]
        assert words in message and "\n" not in message and message.count(f"'{name}'") == 1, message
    assert load("run-time", good).status_code == 200
    models = {m.id: m for m in client.models.list().data}
    assert "run-time" in models and getattr(models["run-time"], "parent", None) == pipeline.model
    assert not {"rank-16", "foreign", "corrupt"} & set(models)

    request = InferenceRequest(request_id="rt", model=pipeline.model, messages=[ChatMessage(**m) for m in MESSAGES])  # type: ignore[arg-type]
    prompt = prompt_token_ids(request, llm.tokenizer)
    want_ids, want_text = generate(llm, prompt, 24, LoRARequest("run-time", 99, str(good)))
    out = client.chat.completions.create(
        model="run-time",
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},  # type: ignore[arg-type]
    )
    assert out.model == "run-time" and out.choices[0].message.content == want_text
    assert out.usage is not None and out.usage.completion_tokens == len(want_ids)

    unloaded = client.post("/unload_lora_adapter", body={"lora_name": "run-time"}, cast_to=httpx.Response)
    assert unloaded.status_code == 200
    with pytest.raises(openai.NotFoundError) as gone:
        client.chat.completions.create(model="run-time", messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
    assert gone.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_killing_the_worker_mid_stream_resumes_the_adapter_request_exactly(
    pipeline: Pipeline, llm: LLM, adapter_dir: Path
) -> None:
    prompt = list(llm.tokenizer.encode(PROMPT))
    ref_ids, ref_text = generate(llm, prompt, KILL_TOKENS, LoRARequest(ADAPTER, 1, str(adapter_dir)))
    # A second worker with LoRA on but no adapter of its own.
    pipeline.start_worker("worker-b", SLUICEGATE_WORKER_LORAS="{}", SLUICEGATE_ENABLE_LORA="true")
    wait_partitions_split(pipeline, ("worker-a", "worker-b"))
    accepted = pipeline.submit(model=ADAPTER, prompt=PROMPT, max_tokens=KILL_TOKENS, temperature=0, ignore_eos=True)
    rid = accepted["request_id"]
    deadline = time.monotonic() + 120
    while len(pipeline.stream_events(rid)) < 40:
        assert time.monotonic() < deadline, "the request never got going"
        time.sleep(0.01)
    owner = pipeline.record(rid).worker_id
    # The router sent it to the worker that holds the adapter; the other one has to load it to take over.
    assert owner == "worker-a"
    assert ADAPTER not in pipeline.heartbeats()["worker-b"].adapters
    pipeline.kill(pipeline.find(owner))
    delivered = len(pipeline.stream_events(rid))
    assert delivered < KILL_TOKENS - 50, "the worker was not killed mid-generation"

    events = pipeline.wait_stream_end(rid, timeout_s=240)
    assert [e.seq for e in events] == list(range(len(events))), "gap or duplicate"
    assert [e.type for e in events].count("done") == 1 and events[-1].type == "done", events[-1]
    assert "restart" not in {e.type for e in events}
    assert [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids] == ref_ids
    assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == ref_text
    assert pipeline.wait_record(rid, "finished").worker_id == "worker-b"
    wait_adapter_advertised(pipeline, "worker-b", timeout_s=30)
