"""The worker's LoRA adapter files: local paths used as they are, fsspec URLs fetched once into the cache (whole or
not at all), and ``--lora NAME=PATH`` / SLUICEGATE_WORKER_LORAS turning LoRA serving on."""

from __future__ import annotations

import uuid
from pathlib import Path

import fsspec
import pytest

from cli.main import CliError, _pairs, _worker_settings, build_parser
from gpu_workers.worker.adapter_files import AdapterFetchError, fetch_adapter, is_remote
from gpu_workers.worker.main import engine_arguments, lora_enabled
from sluicegate.settings import Settings

FILES = {"adapter_config.json": b'{"peft_type": "LORA"}', "adapter_model.safetensors": b"\x02" + bytes(7) + b"{}"}


def memory_adapter(files: dict[str, bytes] = FILES) -> str:
    url = f"memory://adapters/{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    for name, data in files.items():
        fs.pipe_file(f"{url}/{name}", data)
    return url


def test_local_paths_and_file_urls_are_used_in_place(tmp_path: Path) -> None:
    assert not is_remote("/srv/adapters/sql") and not is_remote("file:///srv/adapters/sql")
    assert is_remote("s3://bucket/sql") and is_remote("memory://x")
    assert fetch_adapter(str(tmp_path), tmp_path / "cache", "1") == tmp_path
    assert fetch_adapter(f"file://{tmp_path}", tmp_path / "cache", "1") == tmp_path
    assert not (tmp_path / "cache").exists()


def test_a_url_is_fetched_once_per_registration(tmp_path: Path) -> None:
    url = memory_adapter()
    cache = tmp_path / "cache"
    first = fetch_adapter(url, cache, "7")
    assert {p.name: p.read_bytes() for p in first.iterdir()} == FILES
    # Cached: the files at the URL changing does not matter to the same registration...
    fsspec.filesystem("memory").pipe_file(f"{url}/adapter_config.json", b"{}")
    assert fetch_adapter(url, cache, "7") == first
    assert (first / "adapter_config.json").read_bytes() == FILES["adapter_config.json"]
    # ...while a new registration (a new lora_int_id) gets its own fresh copy.
    second = fetch_adapter(url, cache, "8")
    assert second != first and (second / "adapter_config.json").read_bytes() == b"{}"
    # Nothing half-fetched is left behind.
    assert sorted(p.name for p in cache.iterdir()) == sorted([first.name, second.name])


def test_a_url_missing_a_file_or_unknown_fails_with_the_reason_and_leaves_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    url = memory_adapter({"adapter_config.json": b"{}"})
    with pytest.raises(AdapterFetchError, match=r"has no adapter_model\.safetensors"):
        fetch_adapter(url, cache, "1")
    with pytest.raises(AdapterFetchError, match="cannot open adapter URL"):
        fetch_adapter("nosuchprotocol://bucket/x", cache, "1")
    assert list(cache.iterdir()) == []


def test_lora_flags_add_to_the_settings_and_turn_lora_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from sluicegate.settings import get_settings

    monkeypatch.setenv("SLUICEGATE_WORKER_LORAS", '{"chat": "/a/chat"}')
    monkeypatch.setenv("SLUICEGATE_MODEL", "/m")
    get_settings.cache_clear()
    try:
        args = build_parser().parse_args(["worker", "--lora", "sql=s3://b/sql", "--lora", "x = /p/x"])
        settings = _worker_settings(args)
    finally:
        get_settings.cache_clear()
    assert settings.worker_loras == {"chat": "/a/chat", "sql": "s3://b/sql", "x": "/p/x"}
    assert lora_enabled(settings)
    with pytest.raises(CliError, match="expected NAME=PATH"):
        _pairs(["sql"], "--lora", "NAME=PATH")
    with pytest.raises(CliError, match="given twice"):
        _pairs(["a=/x", "a=/y"], "--lora", "NAME=PATH")


def test_engine_gets_the_lora_knobs_only_when_lora_is_on() -> None:
    off = Settings(model="/m")
    assert not lora_enabled(off) and "enable_lora" not in engine_arguments(off)
    on = Settings(model="/m", enable_lora=True, max_loras=2, max_lora_rank=32)
    args = engine_arguments(on)
    assert (args["enable_lora"], args["max_loras"], args["max_lora_rank"], args["max_cpu_loras"]) == (True, 2, 32, None)
    assert engine_arguments(on.model_copy(update={"max_cpu_loras": 5}))["max_cpu_loras"] == 5
