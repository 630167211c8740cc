"""The engine with an FP8 KV cache (``kv_cache_dtype="fp8"``): settings and refusals, twice the
blocks per GiB of a 16-bit cache, logits close to the unquantized cache's on the test models (torch
backend, and the Triton kernels under the interpreter), checkpoint scales, scales fixed after the
first step across prefix-cache hits and preemption, and the padded decode path CUDA graphs replay.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from needs import needs
from safetensors.torch import save_file

from gpu_workers.engine import LLM, EngineConfig, SamplingParams
from gpu_workers.engine.attention import get_attention_backend
from gpu_workers.engine.attention.kv_quant import FP8_KV_DTYPE
from gpu_workers.engine.attention.metadata import AttentionMetadata
from gpu_workers.engine.execution.model_runner import kv_bytes_per_block

MIN_COSINE = 0.99
PROMPT_LEN, DECODE_STEPS = 48, 24


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def _triton_importable() -> bool:
    try:
        import gpu_workers.engine.attention.triton_kernels  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_mode() -> bool:
    """Whether the kernels can run here: compiled on CUDA, or interpreted (TRITON_INTERPRET=1 before import)."""
    from gpu_workers.engine.attention.triton_kernels import INTERPRETED

    return INTERPRETED or torch.cuda.is_available()


# A missing triton is a missing dependency (a failure under CI); the wrong mode is the machine's.
NEEDS_TRITON = [
    needs(_triton_importable(), "triton", "a dependency of torch; pip install -e '.[dev]'"),
    pytest.mark.skipif(_triton_importable() and not _triton_mode(), reason="needs CUDA or TRITON_INTERPRET=1"),
]


def teacher_forced_logits(llm: LLM, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Float32 logits predicting ``tokens[prompt_len:]`` (and the token after), one sequence in
    blocks 0..n: the prompt in two chunks (the second attends the first from the cache, as a
    prefix-cache hit does), then one decode step per token, every step writing and reading the
    engine's cache through its backend. The first step calibrates FP8 scales not yet fixed."""
    runner = llm.engine.runner
    dev = runner.device
    table = torch.arange(-(-len(tokens) // runner.block_size), dtype=torch.int32, device=dev)[None]
    logits, start = [], 0
    for end in [prompt_len // 2, prompt_len, *range(prompt_len + 1, len(tokens) + 1)]:
        n = end - start
        calibrate = runner.kv_scales is not None and not runner.kv_scales.fixed
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, end, device=dev),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=dev),
            block_tables=table, max_query_len=n, max_seq_len=end, is_decode_only=n == 1,
            query_start_loc_cpu=[0, n], seq_lens_cpu=[end], calibrate_kv_scales=calibrate,
        )  # fmt: skip
        with torch.inference_mode():
            ids = torch.tensor(tokens[start:end], device=dev)
            hidden = runner.model(ids, torch.arange(start, end, device=dev), meta)
            if end >= prompt_len:
                logits.append(runner.model.compute_logits(hidden[-1:]).float())
        if calibrate and runner.kv_scales is not None:
            runner.kv_scales.fixed = True
        start = end
    return torch.cat(logits)


def test_kv_cache_dtype_names_and_refusals() -> None:
    assert EngineConfig(model="m").kv_cache_torch_dtype is None
    for name in ("fp8", "fp8_e4m3", "FP8"):
        assert EngineConfig(model="m", kv_cache_dtype=name).kv_cache_torch_dtype == FP8_KV_DTYPE
    with pytest.raises(ValueError, match="fp8_e5m2 is not supported"):
        EngineConfig(model="m", kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int8'; choose one of auto, fp8, fp8_e4m3"):
        EngineConfig(model="m", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="cannot read an FP8 KV cache"):
        EngineConfig(model="m", kv_cache_dtype="fp8", attention_backend="flash_attn", block_size=256)
    with pytest.raises(ValueError, match="cannot read an FP8 KV cache"):
        get_attention_backend("flash_attn", "cpu", block_size=256, dtype=torch.bfloat16, kv_cache_dtype=FP8_KV_DTYPE)


def test_blocks_per_gib_double_against_a_16_bit_cache(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    path = model_dir("llama")
    # 2^23 bytes: a whole number of blocks in every dtype (fp32 blocks of this model are 8 KiB).
    budget = dict(num_kv_blocks=None, cpu_kv_cache_gb=2.0**-7, max_num_seqs=256)
    bf16 = make_llm(path, dtype="bfloat16", **budget).engine
    fp8 = make_llm(path, dtype="bfloat16", kv_cache_dtype="fp8", **budget).engine
    fp32 = make_llm(path, dtype="float32", **budget).engine
    assert kv_bytes_per_block(fp8.loaded, 16, FP8_KV_DTYPE) * 2 == kv_bytes_per_block(bf16.loaded, 16)
    assert fp8.runner.kv_cache.dtype == FP8_KV_DTYPE and fp8.runner.kv_cache.element_size() == 1
    assert fp8.num_total_blocks == 2 * bf16.num_total_blocks == 4 * fp32.num_total_blocks
    assert fp8.runner.kv_cache.nbytes == bf16.runner.kv_cache.nbytes  # the same budget, twice the tokens


@pytest.mark.parametrize(
    ("variant", "backend"),
    [
        ("llama", "torch"),
        ("llama3_tied", "torch"),
        ("qwen2", "torch"),
        ("qwen3", "torch"),
        pytest.param(
            "llama3_tied",
            "triton",
            marks=NEEDS_TRITON,
        ),
    ],
)
def test_logits_stay_close_to_the_unquantized_cache(
    variant: str,
    backend: str,
    model_dir: Callable[[str], Path],
    make_llm: Callable[..., LLM],
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = model_dir(variant)
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    kwargs = dict(attention_backend=backend, device=device, num_kv_blocks=32, enforce_eager=True)
    reference = make_llm(path, **kwargs)
    quantized = make_llm(path, kv_cache_dtype="fp8", **kwargs)
    prompt = _prompt(7)
    tokens = prompt + reference.generate([prompt], _greedy(DECODE_STEPS))[0].token_ids
    want = teacher_forced_logits(reference, tokens, PROMPT_LEN)
    got = teacher_forced_logits(quantized, tokens, PROMPT_LEN)
    assert quantized.engine.runner.kv_scales is not None and quantized.engine.runner.kv_scales.fixed
    cosine = F.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    worst_row = F.cosine_similarity(got, want, dim=1).min().item()
    argmax = (got.argmax(1) == want.argmax(1)).float().mean().item()
    with capsys.disabled():
        print(f"\nfp8 KV {variant}/{backend}: logits cosine {cosine:.5f} (worst {worst_row:.5f}), argmax {argmax:.3f}")
    assert cosine >= MIN_COSINE and worst_row >= MIN_COSINE


def _with_kv_scales(src: Path, dst: Path, per_layer: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(src, dst)
    save_file({name: t.contiguous() for name, t in per_layer.items()}, str(dst / "kv_scales.safetensors"))
    return dst


def test_checkpoint_scales_are_used_and_kept(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    # Layer 0 per KV head (k/v), layer 1 one shared scalar (the older kv_scale), as checkpoints write them.
    scales = {
        "model.layers.0.self_attn.k_scale": torch.tensor([0.02, 0.03]),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.01, 0.015]),
        "model.layers.1.self_attn.kv_scale": torch.tensor(0.025),
    }
    path = _with_kv_scales(model_dir("llama"), tmp_path / "scaled", scales)
    llm = make_llm(path, kv_cache_dtype="fp8")
    kv_scales = llm.engine.runner.kv_scales
    assert kv_scales is not None and kv_scales.fixed
    given = torch.tensor([[[0.02, 0.03], [0.025, 0.025]], [[0.01, 0.015], [0.025, 0.025]]])
    assert torch.equal(kv_scales.tensor, given)
    out = llm.generate([_prompt(1)], _greedy(8))[0]
    assert len(out.token_ids) == 8
    assert torch.equal(kv_scales.tensor, given)  # no calibration over given scales
    # A 16-bit/32-bit cache loads the same checkpoint and ignores the scales.
    assert make_llm(path).engine.runner.kv_scales is None
    bad = _with_kv_scales(model_dir("llama"), tmp_path / "bad", {"model.layers.0.self_attn.k_scale": torch.ones(3)})
    with pytest.raises(ValueError, match="expected 1 or num_kv_heads=2"):
        make_llm(bad, kv_cache_dtype="fp8")
    partial = _with_kv_scales(model_dir("llama"), tmp_path / "partial", dict(list(scales.items())[:2]))
    with pytest.raises(ValueError, match="but not"):
        make_llm(partial, kv_cache_dtype="fp8")


def test_scales_fixed_after_the_first_step_across_prefix_hits(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(model_dir("llama"), kv_cache_dtype="fp8")
    kv_scales = llm.engine.runner.kv_scales
    assert kv_scales is not None and not kv_scales.fixed
    first = _prompt(3, 40)
    llm.generate([first], _greedy(4))
    assert kv_scales.fixed and bool((kv_scales.tensor != 1.0).all())
    after_first = kv_scales.tensor.clone()
    # A prompt sharing 32 tokens (two whole blocks) reads them from the FP8 cache.
    second = first[:32] + [t * 3 % 509 + 3 for t in first[:20]]
    out = llm.generate([second], _greedy(6))[0]
    assert out.num_cached_tokens == 32 and len(out.token_ids) == 6
    assert torch.equal(kv_scales.tensor, after_first)


def test_preempted_sequence_recomputes_into_the_fp8_cache(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    path = model_dir("llama")
    bulk, chat = _prompt(11, 300), _prompt(12, 256)
    # 34 blocks: the 300-token batch request holds ~19, the 256-token interactive one needs 17.
    tight = make_llm(path, kv_cache_dtype="fp8", num_kv_blocks=34, enable_prefix_caching=False).engine
    roomy = make_llm(path, kv_cache_dtype="fp8", enable_prefix_caching=False).engine
    finals = {}
    for engine in (tight, roomy):
        engine.add_request(bulk, _greedy(40), request_id="bulk", priority=2)
        for _ in range(3):
            engine.step()
        engine.add_request(chat, _greedy(10), request_id="chat", priority=0)
        while engine.has_unfinished():
            for delta in engine.step():
                if delta.final is not None:
                    finals[(engine is tight, delta.request_id)] = delta.final
    assert finals[(True, "bulk")].metrics.num_preemptions >= 1
    assert finals[(False, "bulk")].metrics.num_preemptions == 0
    # Both engines calibrated on the same first step; the recomputed blocks hold the same codes.
    assert torch.equal(tight.runner.kv_scales.tensor, roomy.runner.kv_scales.tensor)
    for request_id in ("bulk", "chat"):
        assert finals[(True, request_id)].token_ids == finals[(False, request_id)].token_ids


@NEEDS_TRITON[0]
@NEEDS_TRITON[1]
def test_padded_decode_path_calibrates_eagerly_then_matches_eager(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    path = model_dir("llama")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kwargs = dict(attention_backend="triton", device=device, dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=32)
    eager = make_llm(path, enforce_eager=True, **kwargs)
    padded = make_llm(path, enforce_eager=True, **kwargs)
    runner = padded.engine.runner
    # The static-buffer path CUDA graphs replay, run eagerly on a CPU.
    runner.enable_decode_graphs(max_num_seqs=4, max_model_len=padded.engine.max_model_len, capture=False)
    # One-token prompts make the very first step decode-shaped: it must still calibrate, outside the graphs.
    firsts = [[5], [9]]
    prompts = [_prompt(21, 20), _prompt(22, 9), _prompt(23, 33)]
    results = []
    for llm in (eager, padded):
        llm.generate(firsts, _greedy(2))
        results.append([o.token_ids for o in llm.generate(prompts, _greedy(5))])
    assert runner.kv_scales is not None and runner.kv_scales.fixed
    assert torch.equal(runner.kv_scales.tensor, eager.engine.runner.kv_scales.tensor)
    assert results[0] == results[1]


@NEEDS_TRITON[0]
@NEEDS_TRITON[1]
def test_cascade_over_a_shared_fp8_prefix_matches_plain_attention(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpu_workers.engine.attention import triton_backend

    calls: list[int] = []
    real = triton_backend.cascade_paged_attention

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_backend, "cascade_paged_attention", counting)
    path = model_dir("llama")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kwargs = dict(attention_backend="triton", device=device, kv_cache_dtype="fp8", num_kv_blocks=48, enforce_eager=True)
    plain = make_llm(path, enable_cascade_attention=False, **kwargs)
    cascade = make_llm(path, **kwargs)
    cascade.engine.runner.cascade_min_prefix_len = 16
    cascade.engine.runner.cascade_min_seqs = 2
    prefix = _prompt(31, 40)
    prompts = [prefix + _prompt(40 + i, n) for i, n in enumerate((3, 8, 1))]
    results = []
    for llm in (plain, cascade):
        llm.generate([prefix[:33]], _greedy(1))  # calibrates on the prefix and caches its two whole blocks
        results.append([o.token_ids for o in llm.generate(prompts, _greedy(4))])
    assert calls, "the shared-prefix decode steps should have taken the cascade path"
    assert results[0] == results[1]
