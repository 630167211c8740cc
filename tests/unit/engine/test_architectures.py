"""The registry's per-architecture facts: every registered class has them, they agree with the GGUF converter's
table and with docs/models.md, a loaded engine names its architecture, and a feature an architecture cannot run
with is refused by name when it loads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_workers.engine import LLM
from gpu_workers.engine.models import ARCHITECTURE_INFO, FEATURES, MODEL_REGISTRY, ArchitectureInfo
from gpu_workers.engine.models.architectures import features_table_markdown
from gpu_workers.engine.models.gguf_convert import ARCHITECTURES as GGUF_ARCHITECTURES

MODELS_DOC = Path(__file__).resolve().parents[3] / "docs" / "models.md"


def test_every_registered_architecture_has_its_facts() -> None:
    assert set(ARCHITECTURE_INFO) == set(MODEL_REGISTRY)
    assert all(info.hf_name == name for name, info in ARCHITECTURE_INFO.items())


def test_gguf_names_agree_with_the_converter() -> None:
    """Each GGUF architecture the converter reads is listed by the architecture it converts to, and every listed one
    is the converter's (a Mixtral GGUF is a ``llama`` file with experts, so two architectures list ``llama``)."""
    listed = {(gguf, info.hf_name) for info in ARCHITECTURE_INFO.values() for gguf in info.gguf_names}
    converted = {(gguf, hf_name) for gguf, (_, hf_name, _) in GGUF_ARCHITECTURES.items()}
    assert converted <= listed
    assert {gguf for gguf, _ in listed} == set(GGUF_ARCHITECTURES)


def test_docs_table_is_the_registrys() -> None:
    assert features_table_markdown() in MODELS_DOC.read_text(), (
        "docs/models.md is stale: paste gpu_workers.engine.models.architectures.features_table_markdown() "
        "between the architecture-table markers"
    )


def test_unknown_features_are_refused_when_declared() -> None:
    with pytest.raises(ValueError, match="unknown features"):
        ArchitectureInfo("XForCausalLM", "x", unsupported={"telepathy": "no"})
    with pytest.raises(KeyError, match="unknown feature"):
        ARCHITECTURE_INFO["LlamaForCausalLM"].supports("telepathy")


def test_the_engine_names_its_architecture(model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(model_dir("qwen3"))
    assert llm.engine.architecture == "Qwen3ForCausalLM"


@pytest.mark.parametrize(
    ("feature", "options"),
    [
        ("lora", {"enable_lora": True}),
        ("cpu_quantization", {"quantization": "cpu-int8"}),
        ("prefix_caching", {}),  # on by default
        ("fp8_kv_cache", {"kv_cache_dtype": "fp8", "enable_prefix_caching": False}),
    ],
)
def test_a_feature_the_architecture_cannot_run_with_is_refused_by_name(
    feature: str,
    options: dict[str, object],
    model_dir: Callable[[str], Path],
    make_llm: Callable[..., LLM],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    info = ARCHITECTURE_INFO["Qwen3ForCausalLM"]
    refusing = ArchitectureInfo(info.hf_name, info.family, info.gguf_names, {feature: "not built for it yet"})
    monkeypatch.setitem(ARCHITECTURE_INFO, "Qwen3ForCausalLM", refusing)
    path = model_dir("qwen3")
    want = f"{FEATURES[feature]} is not supported for Qwen3ForCausalLM: not built for it yet"
    with pytest.raises(ValueError, match=want):
        make_llm(path, **options)
    if feature != "prefix_caching":  # the same model without the feature loads
        make_llm(path)
