"""The asyncio fronts carry LoRA too: ``add_lora`` / ``remove_lora`` / ``list_loras`` run between steps (across the
process boundary for ``ProcessEngine``), requests name an adapter, and a bad adapter fails only its caller."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_workers.engine import AsyncEngine, LoRAError, LoRARequest, SamplingParams
from gpu_workers.engine.entrypoints.engine_front import EngineFront
from gpu_workers.engine.entrypoints.process_engine import ProcessEngine

from .lora_adapters import MergedReference, make_adapter

ENGINE_ARGS = {"max_model_len": 256, "num_kv_blocks": 64, "enable_lora": True, "max_loras": 2}
PROMPTS = [[17, 33, 250, 9, 41, 88, 120], [5, 6, 7, 8, 300, 301, 2, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54]]


@pytest.fixture(scope="module")
def lora_setup(model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    base = model_dir("llama")
    root = tmp_path_factory.mktemp("front_adapters")
    return base, [make_adapter(base, root / f"r{r}", r, seed=10 + r) for r in (4, 8)]


async def _tokens(front: EngineFront, prompt: list[int], lora: LoRARequest | None) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return [t async for d in front.generate(prompt, params, lora_request=lora) for t in d.token_ids]


@pytest.mark.parametrize("kind", ["async", "process"])
async def test_adapter_calls_and_requests(kind: str, lora_setup: tuple[Path, list[Path]], tmp_path: Path) -> None:
    base, (a4, a8) = lora_setup
    ref = MergedReference(base)
    front: EngineFront = (
        AsyncEngine(str(base), **ENGINE_ARGS) if kind == "async" else ProcessEngine(str(base), **ENGINE_ARGS)
    )
    r4, r8 = LoRARequest("r4", 1, str(a4)), LoRARequest("r8", 2, str(a8))
    async with front:
        spec = await front.check_lora(str(a8))
        assert (spec.rank, spec.alpha, len(spec.target_modules)) == (8, 16.0, 7)
        assert await front.list_loras() == []  # checked, not loaded
        assert await front.add_lora(r4)
        assert not await front.add_lora(r4)
        assert await front.list_loras() == [r4]
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "use_dora": true}')
        with pytest.raises(LoRAError, match="DoRA adapters"):
            await front.add_lora(LoRARequest("broken", 3, str(broken)))
        with pytest.raises(LoRAError, match="DoRA adapters"):
            await front.check_lora(str(broken))
        # Weights that are not numbers are found by the check, before a registry would take the adapter.
        nan = tmp_path / "nan"
        shutil.copytree(a8, nan)
        tensors = load_file(str(nan / "adapter_model.safetensors"))
        first_b = next(k for k in sorted(tensors) if "lora_B" in k)
        tensors[first_b] = torch.full_like(tensors[first_b], float("nan"))
        save_file(tensors, str(nan / "adapter_model.safetensors"))
        with pytest.raises(LoRAError, match="NaN or infinite"):
            await front.check_lora(str(nan))
        # A request naming an adapter that cannot load fails alone; the engine serves the next ones.
        with pytest.raises(ValueError, match="DoRA adapters"):
            await _tokens(front, PROMPTS[0], LoRARequest("broken", 3, str(broken)))
        # r8 is loaded on demand by its request.
        for prompt in PROMPTS:
            for lora, path in ((r4, a4), (r8, a8), (None, None)):
                assert await _tokens(front, prompt, lora) == ref.greedy(path, prompt, 6)
        assert {r.lora_name for r in await front.list_loras()} == {"r4", "r8"}
        assert await front.remove_lora(1) and not await front.remove_lora(1)
        assert await front.list_loras() == [r8]
