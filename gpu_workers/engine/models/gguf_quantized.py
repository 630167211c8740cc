"""Keeps a GGUF's projections quantized at load (``quantization`` ``cpu-int8``, ``cpu-int4`` or ``gguf``;
what each keeps: ``quantization/cpu_quant.py``).

The loader still builds the model from the converted Hugging Face folder (``gguf_checkpoint.py``) for the
norms, the embedding, biases and every projection left float. ``GGUFQuantizedWeights`` plans, from the GGUF's
tensor types, which of the model's (merged) projections become ``CpuInt4Linear`` / ``CpuInt8Linear``, swaps
those in while the model is still on the meta device, skips the folder's dequantized copies of their weights
unread (``take``), and fills them from the GGUF's own bytes at the end of the load (``finish``): 4-bit blocks
become the kernel's codes without dequantizing, other types are dequantized by the ``gguf`` library and then
quantized. Where the bytes lie comes from the folder's ``gguf_tensors.json`` (written by the converter; built
once here, with the ``gguf`` library's reader, for a folder converted before it existed). llama.cpp's Q/K row
permutation is undone on the codes and scales as on float rows (it moves whole rows). The pieces of a merged
projection (q/k/v, gate/up) must all plan to the same kind, else it stays float.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn
from transformers import PretrainedConfig

from ..quantization.cpu_linear import DEFAULT_INT4_GROUP, CpuInt4Linear, CpuInt8Linear, quantize_int4
from ..quantization.cpu_quant import gguf_layer_kind
from ..quantization.gguf_blocks import GROUP, INT4_GGUF_TYPES, int4_parts, q8_0_float
from ..quantization.int4_load import MERGED_PROJECTIONS
from .gguf_convert import ARCHITECTURES, TENSOR_INDEX, read_gguf, tensor_index, unpermute_rows
from .gguf_errors import GGUFLoadError

log = logging.getLogger(__name__)

# A phi3 file's projections arrive already fused: one part filling the whole merged layer.
_FUSED_IN_FILE: dict[str, tuple[str, int, int]] = {
    "qkv_proj": ("qkv_proj", 0, 1),
    "gate_up_proj": ("gate_up_proj", 0, 1),
}
_PARTS = MERGED_PROJECTIONS | _FUSED_IN_FILE
_PROJECTION = re.compile(r"^(.*)\.(" + "|".join(_PARTS) + r")\.weight$")
KEPT_TYPES = (*INT4_GGUF_TYPES, "Q8_0")


@dataclass(frozen=True)
class _Part:
    """One GGUF tensor feeding (a row range of) a kept-quantized layer."""

    hf_name: str
    gguf_name: str
    type_name: str  # GGML type, e.g. "Q4_1"
    offset: int  # byte range in the file
    n_bytes: int
    rows: int
    cols: int
    heads: int | None  # rows to un-permute per llama.cpp's Q/K layout, else None


@dataclass(frozen=True)
class _Target:
    """A model module (``...qkv_proj``, ``lm_head``) to build kept-quantized, from its parts in shard order."""

    module: str
    kind: str  # "int4" or "int8"
    parts: tuple[_Part, ...]
    skip: frozenset[str]  # checkpoint names the folder holds for it, left unread


def load_index(folder: Path, gguf_path: Path) -> dict[str, Any]:
    """The converted folder's ``gguf_tensors.json``; built from the GGUF (and saved, where the folder is
    writable) when the folder predates it."""
    index_file = folder / TENSOR_INDEX
    with contextlib.suppress(OSError, ValueError):
        return dict(json.loads(index_file.read_text()))
    index = tensor_index(read_gguf(gguf_path))
    with contextlib.suppress(OSError):
        tmp = index_file.with_name(f".{TENSOR_INDEX}.{os.getpid()}")
        tmp.write_text(json.dumps(index))
        os.replace(tmp, index_file)
    return index


class GGUFQuantizedWeights:
    """The kept-quantized plan of one GGUF for one engine model; a weight reader for ``load_weights``.

    ``folder``: the Hugging Face folder converted from ``gguf_path`` (``gguf_checkpoint.converted_folder``)."""

    def __init__(self, gguf_path: Path, folder: Path, hf_config: PretrainedConfig, method: str) -> None:
        self.path = gguf_path
        self.method = method
        index = load_index(folder, gguf_path)
        arch = index.get("architecture")
        if arch not in ARCHITECTURES:
            raise GGUFLoadError(gguf_path, f"architecture {arch!r} is not supported")
        permuted = ARCHITECTURES[arch][2]
        heads = {"q_proj": hf_config.num_attention_heads, "k_proj": hf_config.num_key_value_heads}
        grouped: dict[str, dict[int, _Part]] = {}
        for t in index["tensors"]:
            name = t["name"]
            if name is None or len(t["shape"]) != 2:
                continue
            rows, cols = t["shape"]
            if name == "model.embed_tokens.weight":
                if not getattr(hf_config, "tie_word_embeddings", False):
                    continue
                target, shard, proj = "lm_head", 0, None  # the tied LM head reads the embedding's blocks
            elif name == "lm_head.weight":
                target, shard, proj = "lm_head", 0, None
            else:
                match = _PROJECTION.match(name)
                if match is None:
                    continue
                prefix, proj = match.groups()
                merged, shard, _ = _PARTS[proj]
                target = f"{prefix}.{merged}"
            part_heads = heads.get(proj or "") if permuted else None
            grouped.setdefault(target, {})[shard] = _Part(
                name, t["gguf_name"], t["type"], t["offset"], t["n_bytes"], rows, cols, part_heads
            )
        self.targets = self._plan(grouped)
        if not self.targets:
            types = sorted({t["type"] for t in index["tensors"] if len(t["shape"]) == 2})
            raise GGUFLoadError(
                gguf_path,
                f"quantization={method!r} keeps {', '.join(KEPT_TYPES)} projections quantized, but this file's "
                f"matrices are {', '.join(types)}; use quantization='cpu-int8' or 'cpu-int4', or leave it empty",
            )
        self.skip = frozenset().union(*(t.skip for t in self.targets.values()))
        self.layers: dict[str, nn.Module] = {}
        self.filled: set[str] = set()
        self._file: np.memmap | None = None

    def _plan(self, grouped: dict[str, dict[int, _Part]]) -> dict[str, _Target]:
        targets: dict[str, _Target] = {}
        for module, shards in grouped.items():
            parts = tuple(shards[i] for i in sorted(shards))
            lm_head = module == "lm_head"
            kinds = {gguf_layer_kind(self.method, p.type_name, lm_head=lm_head) for p in parts}
            kind = next(iter(kinds)) if len(kinds) == 1 else None
            if kind is None:
                if len(kinds) > 1:
                    log.info("%s stays float: its pieces plan to different kinds (%s)", module, kinds)
                continue
            rows, cols = sum(p.rows for p in parts), parts[0].cols
            if kind == "int4" and (rows % 16 or cols % DEFAULT_INT4_GROUP):
                if self.method == "gguf":
                    log.info("%s stays float: [%d, %d] does not fit the int4 kernel", module, rows, cols)
                    continue
                raise ValueError(
                    f"quantization={self.method!r} cannot take {module}: [{rows}, {cols}] needs out_features "
                    f"divisible by 16 and in_features by {DEFAULT_INT4_GROUP}"
                )
            skip = frozenset(p.hf_name for p in parts if p.hf_name != "model.embed_tokens.weight")
            targets[module] = _Target(module, kind, parts, skip)
        return targets

    def swap_in(self, model: nn.Module) -> None:
        """Replace each planned ``nn.Linear`` (on the meta device, before ``to_empty``) by its empty CPU layer."""
        for module, target in self.targets.items():
            linear = model.get_submodule(module)
            if not isinstance(linear, nn.Linear):
                raise ValueError(f"{module} is {type(linear).__name__}, not a linear layer to keep quantized")
            factory = {"dtype": linear.weight.dtype, "device": linear.weight.device}
            bias = linear.bias is not None
            layer: nn.Module
            if target.kind == "int4":
                layer = CpuInt4Linear(linear.in_features, linear.out_features, bias, GROUP, **factory)
            else:
                layer = CpuInt8Linear(linear.in_features, linear.out_features, bias, **factory)
            parent, _, child = module.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, layer)
            self.layers[module] = layer

    def take(self, name: str, tensor_of: Callable[[], torch.Tensor]) -> bool:
        """True for a folder tensor this plan fills from the GGUF instead (it is not read)."""
        return name in self.skip

    def finish(self) -> None:
        """Fill every planned layer from the GGUF's bytes."""
        for module, target in self.targets.items():
            layer = self.layers.get(module)
            if layer is None:
                raise ValueError(f"{module}: swap_in did not run before the weights were filled")
            with torch.no_grad():
                if isinstance(layer, CpuInt4Linear):
                    pieces = [self._int4(p) for p in target.parts]
                    layer.set_codes(*(torch.cat([piece[i] for piece in pieces]) for i in range(3)))
                else:
                    assert isinstance(layer, CpuInt8Linear)
                    layer.set_float(torch.cat([self._float(p) for p in target.parts]))
            self.filled.add(module)
        self._file = None

    def _raw(self, part: _Part) -> np.ndarray:
        """The tensor's bytes, ``[rows, bytes per row]`` (a view of the memory-mapped file)."""
        try:
            if self._file is None:
                self._file = np.memmap(self.path, dtype=np.uint8, mode="r")
            return self._file[part.offset : part.offset + part.n_bytes].reshape(part.rows, -1)
        except (OSError, ValueError) as exc:  # a file cut short since it was converted, and similar
            raise GGUFLoadError(self.path, f"tensor {part.gguf_name!r} cannot be read: {exc}") from exc

    def _float(self, part: _Part) -> torch.Tensor:
        if part.type_name == "Q8_0":
            weight = q8_0_float(self._raw(part), part.rows, part.cols)
        else:
            values = dequantize(self._raw(part), GGMLQuantizationType[part.type_name])
            weight = torch.from_numpy(np.array(values, dtype=np.float32).reshape(part.rows, part.cols))
        return unpermute_rows(weight, part.heads) if part.heads else weight

    def _int4(self, part: _Part) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if part.type_name in INT4_GGUF_TYPES:
            codes, scale, zero = int4_parts(part.type_name, self._raw(part), part.rows, part.cols)
        else:
            codes, scale, zero = quantize_int4(self._float(part), GROUP)
            return codes, scale, zero  # _float already un-permuted the rows
        if part.heads:
            codes, scale, zero = (unpermute_rows(x, part.heads) for x in (codes, scale, zero))
        return codes, scale, zero
