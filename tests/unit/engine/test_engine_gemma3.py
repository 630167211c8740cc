"""Gemma 3 beyond the token-for-token parity of test_engine_vs_transformers.py: a vision-language checkpoint's
language model loads from either key layout (hub and transformers 5) with its tied head and matches
transformers, its image token is refused by name, the hybrid sliding/global model keeps every KV block, and
the features it does not serve are refused at load."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.core.kv_groups import HybridKVBlockManager

from .conftest import MODEL_VARIANTS, HFReference

MM = dict(arch="gemma3_mm", seed=7, num_layers=2, head_dim=32, sliding_window=24)


@pytest.fixture(scope="module")
def mm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("gemma3_mm"), **MM)  # type: ignore[arg-type]


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (70, 9)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_vision_language_checkpoint_serves_its_language_model(
    mm_dir: Path, hf_reference: HFReference, make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    weights = load_file(str(mm_dir / "model.safetensors"))
    assert any(k.startswith("language_model.model.") for k in weights)  # the hub layout, as transformers saves
    assert any(k.startswith("vision_tower.") for k in weights)
    assert not any(k.startswith("language_model.lm_head") for k in weights)  # tied
    # The same weights in transformers 5's in-memory layout.
    moved = tmp_path / "t5_layout"
    moved.mkdir()
    for f in mm_dir.iterdir():
        if f.name != "model.safetensors":
            (moved / f.name).write_bytes(f.read_bytes())
    moves = (("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
             ("multi_modal_projector.", "model.multi_modal_projector."))  # fmt: skip
    renamed = {}
    for key, value in weights.items():
        prefix = next((m for m in moves if key.startswith(m[0])), None)
        renamed[key if prefix is None else prefix[1] + key[len(prefix[0]) :]] = value
    save_file(renamed, str(moved / "model.safetensors"), metadata={"format": "pt"})
    prompts = _prompts(1)
    expected = [hf_reference.greedy(mm_dir, p, 6) for p in prompts]
    for folder in (mm_dir, moved):
        llm = make_llm(folder)
        assert type(llm.engine.loaded.model).__name__ == "Gemma3ForConditionalGeneration"
        assert [o.token_ids for o in llm.generate(prompts, _greedy(6))] == expected


def test_image_token_is_refused_by_name(mm_dir: Path, make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(mm_dir)
    image = llm.engine.loaded.hf_config.image_token_index
    with pytest.raises(ValueError, match="images are not supported: Gemma3ForConditionalGeneration"):
        llm.generate([[5, image, 6]], _greedy(1))
    assert llm.generate([[5, 6]], _greedy(1))[0].token_ids  # text alone still runs


def test_hybrid_model_gets_a_block_table_per_layer_group(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(model_dir("gemma3"))
    window = MODEL_VARIANTS["gemma3"]["sliding_window"]
    assert llm.engine.loaded.sliding_windows == [window, None, window]
    bm = llm.engine.block_manager
    assert isinstance(bm, HybridKVBlockManager)
    assert bm.full.sliding_window is None and bm.sliding.sliding_window == window  # the global layer keeps all
    assert not llm.engine.runner.use_cascade


@pytest.mark.parametrize(
    ("setting", "feature"),
    [({"enable_lora": True}, "LoRA"), ({"tensor_parallel_size": 2}, "Tensor parallelism")],
)
def test_unsupported_features_are_refused_by_name(
    setting: dict[str, object], feature: str, model_dir: Callable[[str], Path]
) -> None:
    with pytest.raises(ValueError, match=f"{feature} is not supported for Gemma3ForCausalLM"):
        LLM(str(model_dir("gemma3")), max_model_len=256, num_kv_blocks=32, **setting)


def test_weights_quantized_at_load_still_run(model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(model_dir("gemma3"), quantization="cpu-int8")
    out = llm.generate([_prompts(2)[0]], _greedy(8))[0]
    assert len(out.token_ids) == 8
