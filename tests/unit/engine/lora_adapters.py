"""Helpers for the LoRA tests: PEFT adapters made with ``peft`` on a base folder, and the merged-model reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from benchmarks.lora import TARGET_MODULES, make_adapter

ALL_TARGETS = list(TARGET_MODULES)
__all__ = ["ALL_TARGETS", "MergedReference", "make_adapter"]


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
