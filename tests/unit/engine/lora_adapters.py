"""Helpers for the LoRA tests: PEFT adapters made with ``peft`` on a base folder, and the merged-model reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base: Path, out: Path, rank: int, *, alpha: float | None = None, targets: list[str] | None = None,
    seed: int = 0, std: float = 0.05, **config: Any,
) -> Path:  # fmt: skip
    """Save a PEFT LoRA adapter for ``base`` with random, non-zero A and B (``std``) into ``out``."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    lora_config = LoraConfig(
        r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=targets or ALL_TARGETS,
        init_lora_weights=False, **config,
    )  # fmt: skip
    peft_model = get_peft_model(model, lora_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(str(out))
    return out


class MergedReference:
    """Greedy continuations of transformers ``generate`` on the base model, or with an adapter merged in by
    ``peft``'s ``merge_and_unload`` (batch of one, fp32, no EOS), cached per (adapter, prompt)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self._models: dict[Path | None, Any] = {}
        self._cache: dict[tuple[Path | None, tuple[int, ...], int], list[int]] = {}

    def _model(self, adapter: Path | None) -> Any:
        if adapter not in self._models:
            model = AutoModelForCausalLM.from_pretrained(str(self.base), dtype=torch.float32)
            if adapter is not None:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
            model.eval()
            model.generation_config.eos_token_id = None
            self._models[adapter] = model
        return self._models[adapter]

    def greedy(self, adapter: Path | None, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (adapter, tuple(prompt), max_new_tokens)
        if key not in self._cache:
            config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = self._model(adapter).generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            self._cache[key] = out[0, len(prompt) :].tolist()
        return self._cache[key]
