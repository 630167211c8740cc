"""Mixture-of-experts GGUFs: Mixtral (architecture ``llama`` with experts, stacked ``ffn_*_exps`` or one tensor per
expert as older files have them) and Qwen3-MoE (``qwen3moe``), written with the ``gguf`` library from tiny
checkpoints, load to transformers' greedy tokens on the original; a file short of an expert is refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
from gguf import GGMLQuantizationType as T

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.models.gguf_errors import GGUFLoadError
from gpu_workers.engine.models.random_checkpoint import make_tiny_model

from .conftest import MODEL_VARIANTS, HFReference, random_prompts
from .gguf_files import write_gguf


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize(
    ("variant", "per_expert", "gguf_arch"),
    [("mixtral", False, "llama"), ("mixtral", True, "llama"), ("qwen3_moe", False, "qwen3moe")],
)
def test_moe_gguf_matches_transformers_on_the_original(
    variant: str, per_expert: bool, gguf_arch: str, tmp_path: Path, hf_reference: HFReference,
    make_llm: Callable[..., LLM],
) -> None:  # fmt: skip
    spec = MODEL_VARIANTS[variant]
    if variant == "qwen3_moe":  # llama.cpp's qwen3moe has experts in every layer (no mlp_only_layers)
        spec = spec | {"config_overrides": spec["config_overrides"] | {"mlp_only_layers": []}}
    hf = make_tiny_model(tmp_path / "hf", **spec)
    write_gguf(hf, tmp_path / "model.gguf", T.F32, per_expert=per_expert)
    reader = gguf.GGUFReader(tmp_path / "model.gguf")
    names = {t.name for t in reader.tensors}
    assert reader.fields["general.architecture"].contents() == gguf_arch
    assert ("blk.0.ffn_gate.7.weight" in names) == per_expert
    assert ("blk.0.ffn_gate_exps.weight" in names) != per_expert
    llm = make_llm(tmp_path / "model.gguf", dtype="float32")
    assert type(llm.engine.loaded.model).__name__ == {"mixtral": "MixtralForCausalLM"}.get(
        variant, "Qwen3MoeForCausalLM"
    )
    prompts = random_prompts(seed=21)[:6]
    outputs = llm.generate([p for p, _ in prompts], [_greedy(n) for _, n in prompts])
    for out, (prompt, max_tokens) in zip(outputs, prompts, strict=True):
        assert out.token_ids == hf_reference.greedy(hf, prompt, max_tokens)


def test_a_per_expert_gguf_short_of_an_expert_is_refused(tmp_path: Path) -> None:
    hf = make_tiny_model(tmp_path / "hf", **MODEL_VARIANTS["mixtral"])
    write_gguf(hf, tmp_path / "full.gguf", T.F32, per_expert=True)
    reader = gguf.GGUFReader(tmp_path / "full.gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "short.gguf"), "llama")
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")):
            continue
        value = field.contents()
        writer.add_key_value(
            field.name, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None
        )
    for t in reader.tensors:
        if t.name != "blk.1.ffn_up.3.weight":
            writer.add_tensor(t.name, t.data.reshape([int(d) for d in reversed(t.shape.tolist())]), raw_dtype=T.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFLoadError, match=r"tensors missing: \['model.layers.1.mlp.experts.up_proj.weight'\]"):
        LLM(str(tmp_path / "short.gguf"), max_model_len=64, num_kv_blocks=8)
