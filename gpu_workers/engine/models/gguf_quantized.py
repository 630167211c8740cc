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

A mixture-of-experts layer's experts (stacked ``mlp.experts.gate_proj.weight`` ``[E, I, H]`` or one tensor per
expert) plan as one target: its ``MoEExperts`` becomes a ``CpuQuantizedExperts``, expert ``e``'s gate/up layer
filled from rows ``e`` of the gate and up tensors and its down layer from the down tensor's; gate and up must plan to
one kind, down to one kind of its own (it may differ: llama.cpp's mixes keep down in a wider type), else the experts
stay float.
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

from ..quantization.cpu_experts import CpuQuantizedExperts, is_stacked_experts
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
# Stacked (no expert number) or per-expert tensors of one MoE layer's experts.
_EXPERTS = re.compile(
    r"^(?P<module>.+\.mlp\.experts)\.(?:(?P<expert>\d+)\.)?(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
_EXPERT_PROJECTIONS = {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
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
    experts: int = 1  # experts stacked in the tensor, ``rows / experts`` rows each


@dataclass(frozen=True)
class _Target:
    """A model module (``...qkv_proj``, ``lm_head``) to build kept-quantized, from its parts in shard order."""

    module: str
    kind: str  # "int4" or "int8"
    parts: tuple[_Part, ...]
    skip: frozenset[str]  # checkpoint names the folder holds for it, left unread


@dataclass(frozen=True)
class _ExpertsTarget:
    """A MoE layer's experts to build kept-quantized: per projection (``gate_up``, ``down``) its kind and, per
    expert, the (tensor, expert inside it) pieces in row order (gate then up)."""

    module: str
    kinds: dict[str, str]
    pieces: dict[str, list[tuple[tuple[_Part, int], ...]]]
    skip: frozenset[str]

    @property
    def num_experts(self) -> int:
        return len(self.pieces["down"])


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
        experts: dict[str, dict[str, dict[int | None, _Part]]] = {}  # module -> projection -> expert -> tensor
        for t in index["tensors"]:
            name = t["name"]
            expert = _EXPERTS.match(name or "")
            if expert is not None:
                *stack, rows, cols = t["shape"]
                experts.setdefault(expert["module"], {}).setdefault(expert["proj"], {})[
                    None if expert["expert"] is None else int(expert["expert"])
                ] = _Part(name, t["gguf_name"], t["type"], t["offset"], t["n_bytes"], rows * (stack or [1])[0], cols,
                          None, (stack or [1])[0])  # fmt: skip
                continue
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
        self.expert_targets = {m: t for m, p in experts.items() if (t := self._plan_experts(m, p)) is not None}
        if not self.targets and not self.expert_targets:
            types = sorted({t["type"] for t in index["tensors"] if len(t["shape"]) == 2})
            raise GGUFLoadError(
                gguf_path,
                f"quantization={method!r} keeps {', '.join(KEPT_TYPES)} projections quantized, but this file's "
                f"matrices are {', '.join(types)}; use quantization='cpu-int8' or 'cpu-int4', or leave it empty",
            )
        self.skip = frozenset().union(*(t.skip for t in (*self.targets.values(), *self.expert_targets.values())))
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

    def _plan_experts(self, module: str, projs: dict[str, dict[int | None, _Part]]) -> _ExpertsTarget | None:
        """The experts of one MoE layer, or None where they stay float (a projection planning to no kind, or
        to two)."""
        pieces: dict[str, list[tuple[tuple[_Part, int], ...]]] = {}
        kinds: dict[str, str] = {}
        for target, names in _EXPERT_PROJECTIONS.items():
            per_proj = [self._expert_pieces(module, name, projs.get(name, {})) for name in names]
            pieces[target] = [tuple(row) for row in zip(*per_proj, strict=True)]
            found = {gguf_layer_kind(self.method, p.type_name, lm_head=False) for pp in per_proj for p, _ in pp}
            kind = next(iter(found)) if len(found) == 1 else None
            if kind is None:
                log.info("%s stays float: its %s tensors plan to %s", module, target, found)
                return None
            first = per_proj[0][0][0]
            rows, cols = sum(pp[0][0].rows // pp[0][0].experts for pp in per_proj), first.cols
            if kind == "int4" and (rows % 16 or cols % DEFAULT_INT4_GROUP):
                if self.method == "gguf":
                    log.info("%s stays float: its %s [%d, %d] does not fit the int4 kernel", module, target, rows, cols)
                    return None
                raise ValueError(
                    f"quantization={self.method!r} cannot take {module}: its {target} [{rows}, {cols}] needs "
                    f"out_features divisible by 16 and in_features by {DEFAULT_INT4_GROUP}"
                )
            kinds[target] = kind
        skip = frozenset(p.hf_name for row in pieces.values() for piece in row for p, _ in piece)
        return _ExpertsTarget(module, kinds, pieces, skip)

    def _expert_pieces(self, module: str, proj: str, parts: dict[int | None, _Part]) -> list[tuple[_Part, int]]:
        """(tensor, expert inside it) of each expert in order, from one stacked tensor or one per expert."""
        if None in parts and len(parts) == 1:
            stacked = parts[None]
            return [(stacked, e) for e in range(stacked.experts)]
        if None in parts or sorted(parts) != list(range(len(parts))) or not parts:
            raise GGUFLoadError(self.path, f"{module}.{proj}: experts {sorted(map(str, parts))} are not 0..E-1")
        return [(parts[e], 0) for e in range(len(parts))]

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
        for module, experts in self.expert_targets.items():
            stacked = model.get_submodule(module)
            if not is_stacked_experts(stacked):
                raise ValueError(f"{module} is {type(stacked).__name__}, not a layer's stacked experts")
            num, two_inter, hidden = stacked.gate_up_proj.shape
            if num != experts.num_experts:
                raise GGUFLoadError(self.path, f"{module}: the file has {experts.num_experts} experts, the model {num}")
            kept = CpuQuantizedExperts(
                num, hidden, two_inter // 2, experts.kinds["gate_up"], experts.kinds["down"],
                dtype=stacked.gate_up_proj.dtype, device=stacked.gate_up_proj.device,
            )  # fmt: skip
            parent, _, child = module.rpartition(".")
            setattr(model.get_submodule(parent), child, kept)
            self.layers[module] = kept

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
        for module, target in self.expert_targets.items():
            experts = self.layers.get(module)
            if not isinstance(experts, CpuQuantizedExperts):
                raise ValueError(f"{module}: swap_in did not run before the weights were filled")
            with torch.no_grad():
                for proj, rows in target.pieces.items():
                    int4 = target.kinds[proj] == "int4"
                    for e, piece in enumerate(rows):
                        if int4:
                            parts = [self._int4(part, i) for part, i in piece]
                            experts.fill(e, proj, tuple(torch.cat([p[j] for p in parts]) for j in range(3)))
                        else:
                            experts.fill(e, proj, torch.cat([self._float(part, i) for part, i in piece]))
            self.filled.add(module)
        self._file = None

    def _raw(self, part: _Part, expert: int = 0) -> np.ndarray:
        """The bytes of the tensor (of its expert ``expert``, when it stacks experts), ``[rows, bytes per row]``
        (a view of the memory-mapped file)."""
        try:
            if self._file is None:
                self._file = np.memmap(self.path, dtype=np.uint8, mode="r")
            rows = part.rows // part.experts
            raw = self._file[part.offset : part.offset + part.n_bytes].reshape(part.rows, -1)
            return raw[expert * rows : (expert + 1) * rows]
        except (OSError, ValueError) as exc:  # a file cut short since it was converted, and similar
            raise GGUFLoadError(self.path, f"tensor {part.gguf_name!r} cannot be read: {exc}") from exc

    def _float(self, part: _Part, expert: int = 0) -> torch.Tensor:
        rows = part.rows // part.experts
        if part.type_name == "Q8_0":
            weight = q8_0_float(self._raw(part, expert), rows, part.cols)
        else:
            values = dequantize(self._raw(part, expert), GGMLQuantizationType[part.type_name])
            weight = torch.from_numpy(np.array(values, dtype=np.float32).reshape(rows, part.cols))
        return unpermute_rows(weight, part.heads) if part.heads else weight

    def _int4(self, part: _Part, expert: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if part.type_name in INT4_GGUF_TYPES:
            rows = part.rows // part.experts
            codes, scale, zero = int4_parts(part.type_name, self._raw(part, expert), rows, part.cols)
        else:
            codes, scale, zero = quantize_int4(self._float(part, expert), GROUP)
            return codes, scale, zero  # _float already un-permuted the rows
        if part.heads:
            codes, scale, zero = (unpermute_rows(x, part.heads) for x in (codes, scale, zero))
        return codes, scale, zero
