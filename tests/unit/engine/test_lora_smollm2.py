"""Multi-LoRA on the real SmolLM2-135M-Instruct: greedy outputs of a batch mixing three adapters (ranks 4, 8, 16,
made with ``peft``) and the base model equal transformers with each adapter merged by ``peft`` (fp32, CPU)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from gpu_workers.engine import LLM, LoRARequest, SamplingParams
from gpu_workers.engine.models.gguf_checkpoint import converted_folder

from .lora_adapters import MergedReference, make_adapter

pytestmark = pytest.mark.slow

REPO_MODELS = Path(__file__).resolve().parents[3] / ".sluicegate" / "models"
QUESTIONS = ("What is the capital of France?", "Why is the sky blue?", "Name a fruit.", "Count to three.")
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def smollm2_folder() -> Path:
    from sluicegate.models.smollm2 import fetch_smollm2

    # The engine's own Hugging Face folder of the GGUF: engine and transformers read the same weights.
    return converted_folder(fetch_smollm2(REPO_MODELS))


def _chat_ids(tokenizer: Any, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return [int(t) for t in (ids if isinstance(ids, list) else ids["input_ids"])]


def test_mixed_adapters_equal_merged_peft(smollm2_folder: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_folder))
    prompts = [_chat_ids(tokenizer, q) for q in QUESTIONS]
    adapters = {r: make_adapter(smollm2_folder, tmp_path / f"r{r}", r, seed=r, std=0.03) for r in (4, 8, 16)}
    loras = {r: LoRARequest(f"smol-r{r}", r, str(path)) for r, path in adapters.items()}
    llm = LLM(str(smollm2_folder), dtype="float32", enable_lora=True, max_model_len=512, num_kv_blocks=64)
    # Each prompt under every adapter and the base model, all in one mixed batch.
    batch = [(p, r) for p in prompts for r in (4, 8, 16, None)]
    outputs = llm.generate(
        [p for p, _ in batch],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        lora_request=[loras[r] if r else None for _, r in batch],
    )
    ref = MergedReference(smollm2_folder)
    for (prompt, rank), out in zip(batch, outputs, strict=True):
        expected = ref.greedy(adapters[rank] if rank else None, prompt, MAX_TOKENS)
        assert out.token_ids == expected, f"{QUESTIONS[prompts.index(prompt)]!r} with r{rank} diverged"
    for rank, path in adapters.items():
        assert any(ref.greedy(path, p, MAX_TOKENS) != ref.greedy(None, p, MAX_TOKENS) for p in prompts), rank
    print(f"SmolLM2 LoRA parity in {time.monotonic() - started:.1f} s")
