"""Shared by the LoRA integration tests: PEFT-style adapter directories and a stand-in for the worker's verify
function (the engine's ``check_adapter`` is the worker's; these tests exercise the pipeline side, so a check of
``adapter_config.json`` against the served base model is enough to tell good files from bad)."""

from __future__ import annotations

import json
from pathlib import Path

from sluicegate.lora.checks import CheckVerdict


def write_adapter(root: Path, name: str, *, rank: int = 8, base: str = "tiny", **config: object) -> Path:
    """A directory with an ``adapter_config.json`` as peft writes it (no weights: the stand-in never reads them)."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    body = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": base,
        **config,
    }
    (path / "adapter_config.json").write_text(json.dumps(body))
    return path


def config_checker(base_model: str):
    """A verify function for ``serve_checks``: refuses what the engine would refuse first (missing or corrupt
    config, not LoRA, another base), with a one-line reason, and reports the rank."""

    async def verify(name: str, path: str) -> CheckVerdict:
        config_file = Path(path) / "adapter_config.json"
        if not config_file.is_file():
            return CheckVerdict(ok=False, reason=f"{name}: no adapter_config.json in {path}")
        try:
            config = json.loads(config_file.read_text())
        except ValueError as exc:
            return CheckVerdict(ok=False, reason=f"{name}: adapter_config.json is not JSON ({exc})")
        if config.get("peft_type") != "LORA":
            return CheckVerdict(ok=False, reason=f"{name}: peft_type {config.get('peft_type')!r} is not LORA")
        if config.get("base_model_name_or_path") not in (None, base_model):
            return CheckVerdict(
                ok=False, reason=f"{name}: made for {config['base_model_name_or_path']!r}, not {base_model!r}"
            )
        return CheckVerdict(ok=True, rank=int(config["r"]))

    return verify
