"""PEFT LoRA adapter folders: check one against the base model, then load its A/B matrices.

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors``, as ``peft``'s ``save_pretrained`` writes
them. ``check_adapter`` reads only the config and the safetensors header (no tensor data), so a worker can vet an
adapter cheaply before anything loads; ``load_adapter`` checks, then reads the tensors. Only plain LoRA on the
attention and MLP projections is taken: everything that would change the math elsewhere (DoRA, rsLoRA's scale,
``modules_to_save``, per-module rank or alpha patterns, LoRA biases) is refused by name, never half-applied.
The engine does not import ``peft``: the file format is small and read directly.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: The projections an adapter may target, as PEFT names them on Llama-family models.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")
_FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_MAX_HEADER_BYTES = 100 << 20


class LoRAError(ValueError):
    """An adapter the engine cannot use; the message is one line naming the problem."""


@dataclass(frozen=True)
class AdapterSpec:
    """What ``check_adapter`` learned from an adapter's config and tensor header."""

    path: str
    rank: int
    alpha: float
    target_modules: frozenset[str]
    base_model_name_or_path: str | None
    # (layer, module) pairs that carry A and B tensors.
    modules: frozenset[tuple[int, str]]

    @property
    def scale(self) -> float:
        """Plain LoRA's scale of ``B @ A``: alpha / r."""
        return self.alpha / self.rank


@dataclass(frozen=True)
class AdapterWeights:
    """A loaded adapter on the CPU: ``(layer, module) -> (A [r, in], B [out, r])`` plus its spec."""

    spec: AdapterSpec
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def module_dims(model_config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """``module -> (in_features, out_features)`` of the base model's projections."""
    hidden = int(model_config.hidden_size)
    heads = int(model_config.num_attention_heads)
    kv_heads = int(getattr(model_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(model_config, "head_dim", None) or hidden // heads)
    inter = int(model_config.intermediate_size)
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}  # fmt: skip


def check_adapter(path: str | Path, model_config: PretrainedConfig, *, max_lora_rank: int) -> AdapterSpec:
    """Vet an adapter folder against the base model from its config and safetensors header alone; ``LoRAError``
    (one line, naming the problem) for anything the engine would not apply exactly as PEFT does."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAError(f"adapter path {str(path)!r} is not a folder")
    config = _read_config(folder)
    rank, alpha = _check_config(config, max_lora_rank)
    header = _read_header(folder / WEIGHTS_FILE)
    dims = module_dims(model_config)
    num_layers = int(model_config.num_hidden_layers)
    found: dict[tuple[int, str], set[str]] = {}
    for key, entry in header.items():
        layer, module, which = _parse_key(key, num_layers)
        in_f, out_f = dims[module]
        expected = (rank, in_f) if which == "A" else (out_f, rank)
        shape = tuple(entry["shape"])
        if len(shape) == 2 and shape != expected:
            found_rank, feature = (shape[0], shape[1]) if which == "A" else (shape[1], shape[0])
            if found_rank != rank and feature == (in_f if which == "A" else out_f):
                raise LoRAError(
                    f"adapter tensor {key} has rank {found_rank}, but r={rank} in {CONFIG_FILE} "
                    "(per-module ranks are not supported)"
                )
        if shape != expected:
            raise LoRAError(
                f"adapter tensor {key} has shape {shape}, the base model needs {expected}: "
                "the adapter was made for a base model with other dimensions"
            )
        found.setdefault((layer, module), set()).add(which)
    if not found:
        raise LoRAError(f"{WEIGHTS_FILE} holds no LoRA weights")
    half = sorted(f"layer {layer} {module}" for (layer, module), ab in found.items() if ab != {"A", "B"})
    if half:
        raise LoRAError(f"adapter has lora_A without lora_B (or the reverse) for {', '.join(half[:3])}")
    targets = frozenset(module for _, module in found)
    listed = config.get("target_modules")
    if isinstance(listed, list) and not targets <= set(listed):
        raise LoRAError(f"adapter tensors target {sorted(targets - set(listed))}, not in its target_modules {listed}")
    base = config.get("base_model_name_or_path")
    return AdapterSpec(
        path=str(folder),
        rank=rank,
        alpha=alpha,
        target_modules=targets,
        base_model_name_or_path=base if isinstance(base, str) else None,
        modules=frozenset(found),
    )


def load_adapter(path: str | Path, model_config: PretrainedConfig, *, max_lora_rank: int) -> AdapterWeights:
    """``check_adapter``, then the A/B tensors (float32 on the CPU); non-finite values are refused."""
    spec = check_adapter(path, model_config, max_lora_rank=max_lora_rank)
    tensors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt", device="cpu") as f:
            for key in f.keys():
                layer, module, which = _parse_key(key, int(model_config.num_hidden_layers))
                tensor = f.get_tensor(key).float()
                if not torch.isfinite(tensor).all():
                    raise LoRAError(f"adapter tensor {key} holds NaN or infinite values")
                tensors.setdefault((layer, module), {})[which] = tensor
    except LoRAError:
        raise
    except Exception as exc:  # a file that changed or broke between check and load
        raise LoRAError(f"{WEIGHTS_FILE} could not be read: {_one_line(exc)}") from exc
    return AdapterWeights(spec, {key: (ab["A"], ab["B"]) for key, ab in tensors.items()})


# ---------------------------------------------------------------------------------------------- helpers
def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _read_config(folder: Path) -> dict[str, Any]:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise LoRAError(f"adapter folder {str(folder)!r} has no {CONFIG_FILE}")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAError(f"{CONFIG_FILE} is not valid JSON: {_one_line(exc)}") from exc
    if not isinstance(config, dict):
        raise LoRAError(f"{CONFIG_FILE} is not a JSON object")
    return config


def _check_config(config: dict[str, Any], max_lora_rank: int) -> tuple[int, float]:
    """Refuse every PEFT option this engine does not apply; returns (r, lora_alpha)."""
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise LoRAError(f"peft_type {peft_type!r} is not supported (only plain LORA adapters)")
    if config.get("use_dora"):
        raise LoRAError("DoRA adapters (use_dora=true) are not supported")
    if config.get("use_rslora"):
        raise LoRAError("rsLoRA adapters (use_rslora=true) are not supported")
    if config.get("modules_to_save"):
        raise LoRAError(f"modules_to_save {config['modules_to_save']} is not supported (only LoRA A/B weights)")
    for option in ("rank_pattern", "alpha_pattern"):
        if config.get(option):
            raise LoRAError(f"{option} (per-module ranks or alphas) is not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise LoRAError(f"LoRA adapters with biases (bias={config.get('bias')!r}) are not supported")
    if config.get("fan_in_fan_out"):
        raise LoRAError("fan_in_fan_out=true (Conv1D targets) is not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        other = sorted(str(t) for t in targets if t not in TARGET_MODULES)
        if other:
            raise LoRAError(f"target modules {other} are not supported (only {', '.join(TARGET_MODULES)})")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"adapter rank r={rank!r} is not a positive integer")
    if rank > max_lora_rank:
        raise LoRAError(f"adapter rank r={rank} exceeds max_lora_rank={max_lora_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoRAError(f"lora_alpha={alpha!r} is not a finite number")
    return rank, float(alpha)


def _read_header(file: Path) -> dict[str, dict[str, Any]]:
    """The safetensors header's tensor entries, checked for consistency against the file's size."""
    if not file.is_file():
        raise LoRAError(f"adapter folder has no {WEIGHTS_FILE} (pickled .bin adapters are not read)")
    size = file.stat().st_size
    try:
        with file.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise LoRAError(f"{WEIGHTS_FILE} is corrupt: shorter than a safetensors header")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(size - 8, _MAX_HEADER_BYTES):
                raise LoRAError(f"{WEIGHTS_FILE} is corrupt: header length {length} exceeds the file")
            header = json.loads(f.read(length))
    except LoRAError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAError(f"{WEIGHTS_FILE} is corrupt: unreadable header ({_one_line(exc)})") from exc
    if not isinstance(header, dict):
        raise LoRAError(f"{WEIGHTS_FILE} is corrupt: its header is not a JSON object")
    data_size = size - 8 - length
    entries: dict[str, dict[str, Any]] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], list(entry["shape"]), entry["data_offsets"]
            numel = math.prod(int(d) for d in shape)
        except (KeyError, TypeError, ValueError) as exc:
            raise LoRAError(f"{WEIGHTS_FILE} is corrupt: bad header entry for {key}") from exc
        if dtype not in _FLOAT_DTYPES:
            raise LoRAError(f"adapter tensor {key} has dtype {dtype}, not a float type")
        if not 0 <= begin <= end <= data_size or end - begin != numel * _FLOAT_DTYPES[dtype]:
            raise LoRAError(f"{WEIGHTS_FILE} is corrupt: tensor {key} lies outside the file or has the wrong size")
        entries[key] = entry
    return entries


def _parse_key(key: str, num_layers: int) -> tuple[int, str, str]:
    """``(layer, module, "A" | "B")`` of a PEFT tensor name; ``LoRAError`` for anything else."""
    match = _KEY.match(key)
    if match is None:
        if "lora_magnitude_vector" in key:
            raise LoRAError("DoRA adapters (lora_magnitude_vector tensors) are not supported")
        if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
            raise LoRAError(f"adapter tensor {key} targets embeddings or the LM head, which is not supported")
        raise LoRAError(f"adapter tensor {key} is not a LoRA A/B weight of {'/'.join(TARGET_MODULES)}")
    layer, parent, module, which = int(match.group(1)), match.group(2), match.group(3), match.group(4)
    if module not in TARGET_MODULES or _PARENT[module] != parent:
        raise LoRAError(f"adapter tensor {key} targets module {parent}.{module}, which is not supported")
    if layer >= num_layers:
        raise LoRAError(f"adapter tensor {key} is for layer {layer}, but the base model has {num_layers} layers")
    return layer, module, which
