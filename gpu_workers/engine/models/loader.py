"""Builds a supported model from a Hugging Face folder (config.json + safetensors) onto a device.

A GGUF file becomes such a folder first (``gguf_checkpoint.py``, cached beside the file).

Checkpoint names map onto the merged projections: ``q/k/v_proj`` fill row slices of
``qkv_proj`` and ``gate/up_proj`` fill ``gate_up_proj``. Sharded checkpoints are read through
``model.safetensors.index.json``. Optional weight quantization runs after loading, but for weights that arrive
quantized: AWQ / GPTQ tensors (``quantization/int4_load.py``) and, with a CPU kept-quantized method, a GGUF's own
blocks (``gguf_quantized.py``) fill their layers while the folder loads. FP8 KV-cache
scales a checkpoint may carry (``self_attn.k_scale`` / ``v_scale``, or one shared ``kv_scale``,
each a scalar or one per KV head, as vLLM and llm-compressor write them) are read aside into
``LoadedModel.kv_scales``; the model runner uses them when the cache is FP8.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from ..config import EngineConfig
from ..quantization import cpu_int4_q8
from ..quantization.cpu_linear import use_int8_activations
from ..quantization.cpu_quant import CPU_QUANTIZATIONS, repack_int4_layers
from ..quantization.cpu_w8a8 import quantize_lm_head
from ..quantization.int4_config import Int4Config
from ..quantization.int4_load import Int4WeightReader, resolve_int4, swap_in_int4_layers
from . import ARCHITECTURE_INFO, MODEL_REGISTRY, ArchitectureInfo, check_features, resolve_architecture_name
from .gguf_checkpoint import converted_folder, find_gguf
from .llama import LlamaForCausalLM, head_dim_of
from .moe_checkpoint import expert_shards, expert_slot, router_name
from .rotary import RotaryEmbedding, rope_type_of

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ..distributed.group import TPGroup
    from .gguf_quantized import GGUFQuantizedWeights

# (checkpoint module name, merged module name, shard index inside the merged weight)
_STACKED_PARAMS: tuple[tuple[str, str, int], ...] = (
    ("q_proj", "qkv_proj", 0),
    ("k_proj", "qkv_proj", 1),
    ("v_proj", "qkv_proj", 2),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)


@dataclass
class LoadedModel:
    """A model on its device plus the facts about it the rest of the engine needs."""

    model: LlamaForCausalLM
    hf_config: PretrainedConfig
    path: Path
    dtype: torch.dtype
    max_model_len: int
    # [2, num_layers, num_kv_heads] fp32 (K, V) FP8 KV-cache scales from the checkpoint, if it has them.
    kv_scales: torch.Tensor | None = None
    # Under tensor parallelism, the KV heads this rank keeps (its KV cache holds only those).
    local_kv_heads: int | None = None
    # The registry's name of the architecture (``MODEL_REGISTRY``), e.g. "Qwen3ForCausalLM".
    architecture: str = ""
    # 4-bit layers that multiply int8 activations (quantization/cpu_int4_q8.py); part of the engine's arithmetic.
    int8_activation_layers: int = 0

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        if self.local_kv_heads is not None:
            return self.local_kv_heads
        return int(self.hf_config.num_key_value_heads or self.hf_config.num_attention_heads)

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.hf_config)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def sliding_windows(self) -> list[int | None]:
        """Per attention layer, its sliding window (None: full attention)."""
        return [layer.sliding_window for layer in self.model.attention_layers]

    @property
    def release_window(self) -> int | None:
        """The window behind which KV blocks can be released: set only when every layer slides by the same
        window (a full-attention layer needs every block; per-group block tables would be needed then)."""
        windows = set(self.sliding_windows)
        if len(windows) != 1:
            return None
        return next(iter(windows))


def resolve_model_path(model: str) -> Path:
    """A local folder as is; a GGUF file (or a folder holding only one) as the folder converted from it
    (``gguf_checkpoint.py``); anything else is fetched as a hub id (config, weights, tokenizer only)."""
    gguf_file = find_gguf(model)
    if gguf_file is not None:
        return converted_folder(gguf_file)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {model!r} has no config.json")
        return path
    looks_like_path = model.startswith(("/", ".", "~")) or model.count("/") > 1
    if looks_like_path:
        raise ValueError(f"model folder {model!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except Exception as exc:  # network, auth or unknown repo: one clear message
        raise ValueError(f"model {model!r} is not a local folder and could not be fetched from the hub: {exc}") from exc
    return Path(local)


def resolve_dtype(
    requested: torch.dtype | None, hf_config: PretrainedConfig, device: torch.device, quantization: str | None = None
) -> torch.dtype:
    """``auto``: the checkpoint's dtype on CUDA, float32 on CPU (CPU half-precision matmuls are slow), but
    bfloat16 under a CPU kept-quantized method (its kernels run in bfloat16: ``quantization/cpu_linear.py``)."""
    if requested is not None:
        return requested
    if device.type != "cuda":
        return torch.bfloat16 if quantization in CPU_QUANTIZATIONS else torch.float32
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return torch.bfloat16
    if dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return torch.float16
    return dtype


def resolve_max_model_len(hf_config: PretrainedConfig, requested: int | None) -> int:
    """Context limit: ``max_position_embeddings`` (a sliding window does not cap it: those layers
    attend their window at any length); ``requested`` may lower it."""
    limit = int(hf_config.max_position_embeddings)
    if requested is None:
        return limit
    if requested > limit and rope_type_of(hf_config) != "dynamic":
        raise ValueError(
            f"max_model_len={requested} exceeds the model's limit of {limit} tokens (max_position_embeddings)"
        )
    return requested


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path} (only safetensors checkpoints are supported)")
    return files


def _shard_slices(model: LlamaForCausalLM) -> dict[str, list[tuple[int, int]]]:
    """Row ranges of each shard inside the merged weights, per merged module kind."""
    attn = model.attention_layers[0]
    # The first dense MLP's size: one with a merged gate_up_proj (Llama's SiLU or Gemma's GeGLU); a mixture-of-experts
    # layer's experts are stacked apart (moe_checkpoint.py).
    dense = (layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate_up_proj"))
    inter = next((mlp.intermediate_size for mlp in dense), 0)
    q, kv = attn.q_size, attn.kv_size
    return {
        "qkv_proj": [(0, q), (q, q + kv), (q + kv, q + 2 * kv)],
        "gate_up_proj": [(0, inter), (inter, 2 * inter)],
    }


def _fused_sizes(config: PretrainedConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """The parts of a checkpoint's fused projections (Phi-3's ``qkv_proj`` / ``gate_up_proj``) in row order,
    at the full model's sizes (a tensor-parallel rank cuts each part afterwards)."""
    heads = int(config.num_attention_heads)
    q, kv = heads * head_dim_of(config), int(config.num_key_value_heads or heads) * head_dim_of(config)
    inter = int(config.intermediate_size)
    return {
        "qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
        "gate_up_proj": (("gate_proj", inter), ("up_proj", inter)),
    }


def _split_fused(
    name: str, tensor: torch.Tensor, fused: dict[str, tuple[tuple[str, int], ...]]
) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of a checkpoint tensor, or of each part of a fused one under its part's name: the
    loader then stacks the parts back into the merged layer like a Llama checkpoint's separate projections."""
    fused_name = next((f for f in fused if f".{f}." in name), None)
    if fused_name is None:
        return [(name, tensor)]
    parts = fused[fused_name]
    rows = sum(size for _, size in parts)
    if tensor.shape[0] != rows:
        raise ValueError(f"checkpoint tensor {name} has {tensor.shape[0]} rows; the config implies {rows}")
    split = tensor.split([size for _, size in parts])
    return [(name.replace(f".{fused_name}.", f".{part}."), t) for (part, _), t in zip(parts, split, strict=True)]


def _copy_into(
    params: dict[str, nn.Parameter],
    slices: dict[str, list[tuple[int, int]]],
    shards_of: dict[str, Sequence[int]],
    name: str,
    tensor: torch.Tensor,
) -> list[tuple[str, int]] | None:
    """Copy checkpoint tensor ``name`` into its parameter (a row slice of a merged one, or an expert's slot of a
    stacked expert one); the ``(parameter, shard)`` pairs filled, or None when the model has no place for it."""
    slot = expert_slot(name, params)
    if slot is not None:
        target, dest, covered = slot.param, params[slot.param].data[slot.index], list(slot.shards)
    else:
        target, shard = router_name(name) or name, None
        for src, dst, idx in _STACKED_PARAMS:
            if f".{src}." in name:
                target, shard = name.replace(f".{src}.", f".{dst}."), idx
                break
        if target not in params:
            return None
        dest = params[target].data
        if shard is not None:
            start, end = slices[target.split(".")[-2]][shard]
            dest = dest[start:end]
        # A whole merged (or stacked) tensor fills every shard of its parameter.
        covered = [shard] if shard is not None else list(shards_of[target])
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(tensor)
    return [(target, s) for s in covered]


class WeightReader(Protocol):
    """Takes checkpoint tensors by name instead of the float loader, and checks or fills at the end."""

    def take(self, name: str, tensor_of: Callable[[], torch.Tensor]) -> bool: ...

    def finish(self) -> None: ...


_KV_SCALE_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale)$")


class _KVScaleReader:
    """Collects a checkpoint's per-layer KV-cache scale tensors into one ``[2, layers, kv_heads]``."""

    def __init__(self, num_layers: int, num_kv_heads: int) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.found: dict[tuple[int, int], torch.Tensor] = {}  # (0 = K / 1 = V, layer) -> [kv_heads]

    def take(self, name: str, tensor_of: Callable[[], torch.Tensor]) -> bool:
        """Keep ``name`` if it is a KV scale (True), else leave it to the weights (False)."""
        match = _KV_SCALE_NAME.match(name)
        if match is None:
            return False
        layer, kind = int(match.group(1)), match.group(2)
        tensor = tensor_of().float().flatten()
        if layer >= self.num_layers or tensor.numel() not in (1, self.num_kv_heads):
            raise ValueError(
                f"checkpoint KV scale {name} has {tensor.numel()} values; expected 1 or num_kv_heads="
                f"{self.num_kv_heads} (and a layer below {self.num_layers})"
            )
        for index in {"k_scale": (0,), "v_scale": (1,), "kv_scale": (0, 1)}[kind]:
            self.found[(index, layer)] = tensor.expand(self.num_kv_heads).clone()
        return True

    def result(self) -> torch.Tensor | None:
        if not self.found:
            return None
        missing = [f"{'kv'[i]}_scale of layer {layer}" for i in (0, 1) for layer in range(self.num_layers)
                   if (i, layer) not in self.found]  # fmt: skip
        if missing:
            raise ValueError(f"checkpoint has KV-cache scales for some layers but not: {missing[:4]}")
        return torch.stack([torch.stack([self.found[(i, layer)] for layer in range(self.num_layers)]) for i in (0, 1)])


def load_weights(
    model: LlamaForCausalLM,
    path: Path,
    int4: Int4Config | None = None,
    cut: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    readers: Sequence[WeightReader] = (),
) -> torch.Tensor | None:
    """Copy every checkpoint tensor into its (possibly merged) parameter; error on gaps or extras.
    ``int4``: the model's projections are ``Int4Linear`` and take the packed tensors. ``cut``: cuts each
    tensor to this tensor-parallel rank's part as it is read. ``readers``: more readers offered each tensor
    first (a GGUF's kept-quantized layers), finished after the last file.
    Returns the checkpoint's KV-cache scales (``[2, layers, kv_heads]``), or None without them."""
    int4_reader = None if int4 is None else Int4WeightReader(model, int4)
    readers = [*readers, *([int4_reader] if int4_reader is not None else [])]
    attn = model.attention_layers[0]
    kv_scales = _KVScaleReader(len(model.attention_layers), attn.num_kv_heads)
    params = dict(model.named_parameters(remove_duplicate=False))
    slices = _shard_slices(model)
    fused_sizes = _fused_sizes(model.config)
    expected: set[tuple[str, int]] = set()
    shards_of: dict[str, Sequence[int]] = {}  # of a parameter a checkpoint may fill in parts
    for name, param in params.items():
        if model.tie_word_embeddings and name == "lm_head.weight":
            continue
        merged = next((m for m in slices if f".{m}." in name), None)
        shards_of[name] = expert_shards(name, param) or (range(len(slices[merged])) if merged else [0])
        expected.update((name, s) for s in shards_of[name])
    loaded: set[tuple[str, int]] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for file in _weight_files(path):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for stored_name in f.keys():
                    # A multimodal checkpoint's language model sits under a prefix; its vision tower is skipped.
                    ckpt_name = model.checkpoint_name(stored_name)
                    if ckpt_name is None or "rotary_emb.inv_freq" in ckpt_name:
                        continue
                    if ckpt_name.startswith("lm_head.") and model.tie_word_embeddings:
                        continue
                    if kv_scales.take(ckpt_name, lambda name=stored_name: f.get_tensor(name)):
                        continue
                    if any(r.take(ckpt_name, lambda n=stored_name: f.get_tensor(n)) for r in readers):
                        continue
                    tensor = f.get_tensor(stored_name)
                    for name, part in _split_fused(ckpt_name, tensor, fused_sizes):
                        filled = _copy_into(params, slices, shards_of, name, part if cut is None else cut(name, part))
                        if filled is None:
                            unexpected.append(name)
                        else:
                            loaded.update(filled)
    if unexpected:
        raise ValueError(f"checkpoint has tensors this model does not use: {unexpected[:5]}")
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {[f'{n}[{s}]' for n, s in missing[:5]]}")
    for reader in readers:
        reader.finish()
    return kv_scales.result()


def _gguf_quantized(
    config: EngineConfig, folder: Path, hf_config: PretrainedConfig, int4: Int4Config | None, info: ArchitectureInfo
) -> GGUFQuantizedWeights | None:
    """The kept-quantized plan of a GGUF model under a CPU method, else None; ``gguf`` needs a GGUF, and an
    architecture that cannot keep a GGUF's blocks (``info``) is refused by name."""
    if config.quantization not in CPU_QUANTIZATIONS or int4 is not None:
        return None
    gguf_file = find_gguf(config.model)
    if gguf_file is None:
        if config.quantization == "gguf":
            raise ValueError(
                f"quantization='gguf' keeps a GGUF file's own quantized blocks, but model {config.model!r} is "
                "not a .gguf file (nor a folder holding one); use 'cpu-int8' or 'cpu-int4' to quantize a float "
                "checkpoint at load"
            )
        return None  # a float checkpoint: quantize_model converts it after loading
    info.refuse("gguf_quantized")
    from .gguf_quantized import GGUFQuantizedWeights

    return GGUFQuantizedWeights(gguf_file, folder, hf_config, config.quantization)


def load_model(config: EngineConfig, tp_group: TPGroup | None = None) -> LoadedModel:
    """Read the config, build the model on ``config.device`` in the resolved dtype, load weights,
    then quantize if asked. ``tp_group``: build and load only this tensor-parallel rank's shard."""
    device = torch.device(config.device)
    path = resolve_model_path(config.model)
    hf_config = AutoConfig.from_pretrained(str(path))
    architecture = resolve_architecture_name(getattr(hf_config, "architectures", None))
    model_cls, info = MODEL_REGISTRY[architecture], ARCHITECTURE_INFO[architecture]
    check_features(info, config)  # a feature it cannot run with, refused by name (before whether the device can)
    if config.quantization is not None:
        from ..quantization import check_quantization_supported

        check_quantization_supported(config.quantization, device)
    hf_config = model_cls.text_config(hf_config)
    int4 = resolve_int4(config.quantization, hf_config)  # AWQ / GPTQ checkpoints, else None
    if int4 is not None:
        info.refuse("int4_checkpoints")
    gguf_weights = _gguf_quantized(config, path, hf_config, int4, info)
    dtype = resolve_dtype(config.torch_dtype, hf_config, device, config.quantization)
    max_model_len = resolve_max_model_len(hf_config, config.max_model_len)
    shard = None
    with torch.device("meta"):
        model = model_cls(hf_config, max_len=max_model_len)
        if tp_group is not None:
            from ..distributed.shard import TPShard, parallelize

            shard = TPShard.plan(hf_config, tp_group.rank, tp_group.world_size)
            parallelize(model, shard, tp_group)
    if int4 is not None:
        swap_in_int4_layers(model, int4, dtype)
    if gguf_weights is not None:
        gguf_weights.swap_in(model)
    model = model.to(dtype=dtype).to_empty(device=device)
    if model.tie_word_embeddings and isinstance(getattr(model.lm_head, "weight", None), nn.Parameter):
        # to_empty() replaces parameters one module at a time, which unties shared weights. (A kept-quantized
        # LM head holds no float weight: it was filled from the embedding's blocks, the embedding stays float.)
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():  # one table, or one per layer kind (Gemma 3's local and global RoPE)
        if isinstance(module, RotaryEmbedding):
            module.reset_cache(dtype)
    cut = shard.shard_tensor if shard is not None else None
    kv_scales = load_weights(model, path, int4, cut, readers=[gguf_weights] if gguf_weights is not None else [])
    model.eval()
    if int4 is not None and config.quantization == "cpu-int4":
        model = repack_int4_layers(model)
    elif config.quantization is not None and int4 is None and gguf_weights is None:
        from ..quantization import quantize_model

        model = quantize_model(model, config.quantization)
    int8_layers = 0
    if config.device.type == "cpu" and cpu_int4_q8.wanted(config.cpu_int4_activations):
        int8_layers = use_int8_activations(model)
        log.info("int4 layers on int8 activations", extra={"layers": int8_layers, "isa": cpu_int4_q8.isa_name()})
    if config.lm_head_quantization is not None:
        quantize_lm_head(model, config.lm_head_quantization)
    return LoadedModel(
        model=model,
        hf_config=hf_config,
        path=path,
        dtype=dtype,
        max_model_len=max_model_len,
        kv_scales=kv_scales,
        local_kv_heads=shard.num_kv_heads if shard is not None else None,
        architecture=architecture,
        int8_activation_layers=int8_layers,
    )
