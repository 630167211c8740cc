"""PEFT adapter folders: ``check_adapter`` reads config + safetensors header and refuses, in one line naming it,
every adapter the engine would not apply exactly as PEFT does; ``load_adapter`` returns the A/B matrices."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from gpu_workers.engine.lora import LoRAError, check_adapter
from gpu_workers.engine.lora.peft_files import WEIGHTS_FILE, load_adapter
from gpu_workers.engine.models.random_checkpoint import make_tiny_model

from .lora_adapters import ALL_TARGETS, make_adapter


@pytest.fixture(scope="module")
def base(model_dir: Callable[[str], Path]) -> Path:
    return model_dir("llama")


@pytest.fixture(scope="module")
def good(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(base, tmp_path_factory.mktemp("lora") / "good", 8, alpha=4, targets=["q_proj", "down_proj"])


def _refused(path: Path, base: Path, match: str, max_lora_rank: int = 16) -> None:
    with pytest.raises(LoRAError, match=match) as info:
        check_adapter(path, AutoConfig.from_pretrained(str(base)), max_lora_rank=max_lora_rank)
    assert "\n" not in str(info.value)


def test_check_and_load(good: Path, base: Path) -> None:
    config = AutoConfig.from_pretrained(str(base))
    spec = check_adapter(good, config, max_lora_rank=8)
    assert (spec.rank, spec.alpha, spec.scale) == (8, 4.0, 0.5)
    assert spec.target_modules == frozenset({"q_proj", "down_proj"})
    assert spec.base_model_name_or_path == str(base)
    assert spec.modules == frozenset((layer, m) for layer in range(2) for m in ("q_proj", "down_proj"))
    weights = load_adapter(good, config, max_lora_rank=8)
    saved = load_file(str(good / WEIGHTS_FILE))
    a, b = weights.modules[(1, "down_proj")]
    assert torch.equal(a, saved["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"])
    assert torch.equal(b, saved["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"])
    assert a.shape == (8, config.intermediate_size) and b.shape == (config.hidden_size, 8)


def test_corrupt_or_missing_files(good: Path, base: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    data = (good / WEIGHTS_FILE).read_bytes()
    (truncated / WEIGHTS_FILE).write_bytes(data[: len(data) - 100])
    _refused(truncated, base, "adapter_model.safetensors is corrupt: tensor .* lies outside the file")
    (truncated / WEIGHTS_FILE).write_bytes(b"\xff" * 64)
    _refused(truncated, base, "adapter_model.safetensors is corrupt: header length")
    (truncated / WEIGHTS_FILE).write_bytes(data[:8] + b"{not json" + data[17:])
    _refused(truncated, base, "adapter_model.safetensors is corrupt: unreadable header")
    (truncated / WEIGHTS_FILE).unlink()
    _refused(truncated, base, "has no adapter_model.safetensors")
    (truncated / "adapter_config.json").write_text("{")
    _refused(truncated, base, "adapter_config.json is not valid JSON")
    _refused(tmp_path / "absent", base, "is not a folder")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"use_dora": True}, "DoRA adapters"),
        ({"use_rslora": True}, "rsLoRA adapters"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"targets": ["q_proj", "embed_tokens"]}, r"target modules \['embed_tokens'\] are not supported"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"bias": "lora_only"}, "biases"),
    ],
)
def test_refused_peft_options(options: dict, match: str, base: Path, tmp_path: Path) -> None:
    targets = options.pop("targets", ALL_TARGETS)
    _refused(make_adapter(base, tmp_path / "a", 4, targets=targets, **options), base, match)


def test_rank_above_max(good: Path, base: Path) -> None:
    _refused(good, base, "adapter rank r=8 exceeds max_lora_rank=4", max_lora_rank=4)


def test_adapter_for_another_base(base: Path, tmp_path: Path) -> None:
    other = make_tiny_model(tmp_path / "wide", hidden_size=96, num_heads=4, num_kv_heads=2)
    adapter = make_adapter(other, tmp_path / "for-wide", 4)
    _refused(adapter, base, r"has shape \(4, 256\), the base model needs \(4, 192\): .* other dimensions")
    deeper = make_tiny_model(tmp_path / "deep", num_layers=3)
    _refused(make_adapter(deeper, tmp_path / "for-deep", 4), base, "is for layer 2, but the base model has 2 layers")


def test_other_peft_type_and_tensors(good: Path, base: Path, tmp_path: Path) -> None:
    folder = tmp_path / "ia3"
    folder.mkdir()
    config = json.loads((good / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    (folder / WEIGHTS_FILE).write_bytes((good / WEIGHTS_FILE).read_bytes())
    _refused(folder, base, "peft_type 'IA3' is not supported")
    # Tensors beyond the config's target_modules (a hand-edited config) are caught from the header.
    (folder / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj"]}))
    _refused(folder, base, r"adapter tensors target \['down_proj'\], not in its target_modules")
