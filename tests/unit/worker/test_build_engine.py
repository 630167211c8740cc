"""The worker builds its engine from ``SLUICEGATE_*`` settings: every engine knob a GPU operator needs arrives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from gpu_workers.engine import AsyncEngine, EngineConfig, ProcessEngine
from gpu_workers.engine.models.random_checkpoint import make_tiny_model
from gpu_workers.engine.spec_decode import SpeculativeConfig
from gpu_workers.worker.main import build_engine, engine_process_env
from sluicegate.settings import Settings


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    make_tiny_model(out)
    return out


async def test_engine_knobs_come_from_settings(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "MODEL": str(tiny),
        "BLOCK_SIZE": "32",
        "ENABLE_PREFIX_CACHING": "false",
        "ENABLE_CASCADE_ATTENTION": "false",
        "ENFORCE_EAGER": "true",
        "GPU_MEMORY_UTILIZATION": "0.5",
        "MAX_MODEL_LEN": "256",
        "MAX_NUM_SEQS": "3",
        "KV_CACHE_GB": "0.01",
        "ATTENTION_BACKEND": "torch",
        "KV_CACHE_DTYPE": "fp8",
        "SPECULATIVE_METHOD": "ngram",
        "NUM_SPECULATIVE_TOKENS": "3",
        "SPECULATIVE_PROMPT_LOOKUP_MAX": "2",
    }.items():
        monkeypatch.setenv(f"SLUICEGATE_{name}", value)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    process = build_engine(Settings())
    assert isinstance(process, ProcessEngine)  # the default (SLUICEGATE_ENGINE_MODE=auto)
    monkeypatch.setenv("SLUICEGATE_ENGINE_MODE", "thread")
    thread = build_engine(Settings())
    assert isinstance(thread, AsyncEngine)
    assert thread.engine.max_model_len == 256
    async with process:
        assert process.spec is not None and process.spec.max_model_len == 256
        assert process.pid is not None
        # A CPU engine's process runs niced (SLUICEGATE_ENGINE_CPU_NICE, 10 by default).
        assert os.getpriority(os.PRIO_PROCESS, process.pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
        # ... and its OpenMP threads wait passively (SLUICEGATE_ENGINE_CPU_WAIT_POLICY), set before torch loads.
        assert b"OMP_WAIT_POLICY=PASSIVE" in _environ_of(process.pid)
    for config in (process.config, thread.engine.config):
        _assert_knobs(config)


def _environ_of(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def _assert_knobs(config: EngineConfig) -> None:
    assert (config.block_size, config.enable_prefix_caching, config.enable_cascade_attention) == (32, False, False)
    assert (config.enforce_eager, config.gpu_memory_utilization, config.max_model_len) == (True, 0.5, 256)
    assert (config.max_num_seqs, config.cpu_kv_cache_gb, config.attention_backend) == (3, 0.01, "torch")
    assert config.kv_cache_dtype == "fp8"
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2)


def test_defaults_leave_the_model_its_own_length(tiny: Path) -> None:
    engine = build_engine(Settings(model=str(tiny), kv_cache_gb=0.01, engine_mode="thread")).engine
    assert engine.max_model_len == 2048  # the tiny model's max_position_embeddings
    assert engine.config.enable_prefix_caching and not engine.config.enforce_eager
    assert engine.config.speculative_config is None and engine.speculator is None  # speculation is opt-in


def test_draft_model_speculation_comes_from_settings(tiny: Path) -> None:
    settings = Settings(
        model=str(tiny), kv_cache_gb=0.01, engine_mode="thread", max_model_len=256,
        speculative_method="draft_model", speculative_model=str(tiny), num_speculative_tokens=2,
    )  # fmt: skip
    engine = build_engine(settings).engine
    assert engine.config.speculative_config == SpeculativeConfig(
        method="draft_model", model=str(tiny), num_speculative_tokens=2
    )
    assert engine.speculator is not None and engine.speculator.draft_model is not None
    # The draft's cache has one block for each of the target's, out of the same KV budget.
    assert engine.speculator.draft_model.pool.num_blocks == engine.num_total_blocks
    with pytest.raises(ValueError, match="needs model"):
        build_engine(Settings(model=str(tiny), engine_mode="thread", speculative_method="draft_model"))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("BLOCK_SIZE", "0"),
        ("GPU_MEMORY_UTILIZATION", "1.5"),
        ("MAX_MODEL_LEN", "-1"),
        ("SPECULATIVE_METHOD", "medusa"),
        ("NUM_SPECULATIVE_TOKENS", "0"),
        ("KV_CACHE_DTYPE", "int8"),
    ],
)
def test_bad_engine_settings_are_refused_by_name(name: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(f"SLUICEGATE_{name}", value)
    with pytest.raises(ValidationError, match=name.lower()):
        Settings()


def test_the_engine_wait_policy_yields_to_the_environment_and_spares_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert engine_process_env(Settings()) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert engine_process_env(Settings(engine_cpu_wait_policy="active")) == {"OMP_WAIT_POLICY": "ACTIVE"}
    assert engine_process_env(Settings(engine_cpu_wait_policy="inherit")) == {}
    assert engine_process_env(Settings(device="cuda")) == {}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert engine_process_env(Settings()) == {}
    with pytest.raises(ValidationError, match="engine_cpu_wait_policy"):
        Settings(engine_cpu_wait_policy="spin")
