"""Loads AWQ / GPTQ INT4 checkpoints into the engine's model: decides from ``config.json`` (and the
requested ``quantization``) whether a checkpoint is INT4, swaps the projections of the freshly
built (meta) model for ``Int4Linear``, and gathers each projection's packed tensors while the
loader streams the safetensors files.

The checkpoint holds ``q/k/v_proj`` and ``gate/up_proj`` separately while the model merges them;
the pieces of one merged projection are converted to the engine layout and concatenated along the
outputs as soon as all of them have been read, so at most one layer's packed tensors wait in
host memory at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from .int4_config import INT4_METHODS, Int4Config, checkpoint_int4_config
from .int4_formats import awq_to_engine, gptq_to_engine
from .int4_linear import Int4Linear

# checkpoint projection -> (merged module, shard index, number of shards)
MERGED_PROJECTIONS: dict[str, tuple[str, int, int]] = {
    "q_proj": ("qkv_proj", 0, 3),
    "k_proj": ("qkv_proj", 1, 3),
    "v_proj": ("qkv_proj", 2, 3),
    "gate_proj": ("gate_up_proj", 0, 2),
    "up_proj": ("gate_up_proj", 1, 2),
    "o_proj": ("o_proj", 0, 1),
    "down_proj": ("down_proj", 0, 1),
}
_INT4_TENSOR = re.compile(r"^(.*)\.(" + "|".join(MERGED_PROJECTIONS) + r")\.(qweight|qzeros|scales|g_idx)$")


def resolve_int4(requested: str | None, hf_config: object) -> Int4Config | None:
    """The checkpoint's INT4 config, checked against the engine's ``quantization`` setting:
    None (auto-detect), the same method, or ``cpu-int4`` (the same INT4, repacked for the CPU kernel after
    loading: ``cpu_quant.repack_int4_layers``); an on-the-fly method on an INT4 checkpoint is refused."""
    cfg = checkpoint_int4_config(hf_config)
    if cfg is None:
        if requested in INT4_METHODS:
            raise ValueError(
                f"quantization={requested!r} needs a checkpoint quantized with {requested.upper()} "
                "(config.json quantization_config), but this checkpoint has none"
            )
        return None
    if requested not in (None, cfg.method, "cpu-int4"):
        raise ValueError(
            f"the checkpoint is already quantized with {cfg.method} (config.json quantization_config); "
            f"set quantization to {cfg.method!r}, 'cpu-int4' (its INT4 on the CPU kernel) or leave it empty, "
            f"not {requested!r}"
        )
    return cfg


def swap_in_int4_layers(model: nn.Module, cfg: Int4Config, dtype: torch.dtype) -> None:
    """Replace every projection ``nn.Linear`` but the LM head with an ``Int4Linear`` of the same
    shape, on the linear's device (the meta device while the loader builds the model)."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or name.rsplit(".", 1)[-1] == "lm_head":
            continue
        layer = Int4Linear(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            cfg=cfg,
            dtype=dtype,
            device=module.weight.device,
        )
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)


class Int4WeightReader:
    """Takes a checkpoint's INT4 tensors by name and fills the model's ``Int4Linear`` layers."""

    def __init__(self, model: nn.Module, cfg: Int4Config) -> None:
        self.cfg = cfg
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, Int4Linear)}
        self.pending: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        self.done: set[str] = set()
        self.kinds = (
            ("qweight", "qzeros", "scales", "g_idx") if cfg.method == "gptq" else ("qweight", "qzeros", "scales")
        )

    def take(self, name: str, tensor_of: Callable[[], torch.Tensor]) -> bool:
        """Keep ``name`` if it is an INT4 projection tensor (True), else leave it to the loader."""
        match = _INT4_TENSOR.match(name)
        if match is None:
            return False
        prefix, proj, kind = match.groups()
        merged, shard, shards = MERGED_PROJECTIONS[proj]
        target = f"{prefix}.{merged}"
        if target not in self.layers or kind not in self.kinds:
            raise ValueError(f"checkpoint tensor {name} has no INT4 projection to go to in this model")
        pieces = self.pending.setdefault(target, {}).setdefault(shard, {})
        if kind in pieces or target in self.done:
            raise ValueError(f"checkpoint tensor {name} appears twice")
        pieces[kind] = tensor_of()
        parts = self.pending[target]
        if len(parts) == shards and all(len(p) == len(self.kinds) for p in parts.values()):
            self._fill(target, [parts[s] for s in range(shards)])
            del self.pending[target]
            self.done.add(target)
        return True

    def _convert(self, name: str, p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if self.cfg.method == "awq":
            return (*awq_to_engine(name, p["qweight"], p["qzeros"], p["scales"], self.cfg), None)
        return gptq_to_engine(name, p["qweight"], p["qzeros"], p["scales"], p["g_idx"], self.cfg)

    def _fill(self, target: str, parts: list[dict[str, torch.Tensor]]) -> None:
        layer = self.layers[target]
        converted = [self._convert(f"{target}[{i}]", p) for i, p in enumerate(parts)]
        qweight, zeros, scales = (torch.cat([c[j] for c in converted], dim=1) for j in range(3))
        g_idxs = [c[3] for c in converted]
        if any(not torch.equal(g, g_idxs[0]) for g in g_idxs[1:] if g is not None and g_idxs[0] is not None):
            raise ValueError(f"{target}: the merged projections have different g_idx (act-order) orders")
        expected = (layer.qweight.shape, layer.zeros.shape, layer.scales.shape)
        if (qweight.shape, zeros.shape, scales.shape) != expected:
            raise ValueError(
                f"{target}: checkpoint INT4 tensors give qweight/zeros/scales of shapes "
                f"{tuple(qweight.shape)}/{tuple(zeros.shape)}/{tuple(scales.shape)}, expected "
                f"{'/'.join(str(tuple(s)) for s in expected)}"
            )
        with torch.no_grad():
            layer.qweight.copy_(qweight)
            layer.zeros.copy_(zeros)
            layer.scales.copy_(scales)
            if layer.g_idx is not None and g_idxs[0] is not None:
                layer.g_idx.copy_(g_idxs[0])

    def finish(self) -> None:
        """Error if any INT4 projection was not (completely) in the checkpoint."""
        missing = sorted(set(self.layers) - self.done)
        if missing:
            raise ValueError(f"checkpoint is missing INT4 tensors ({', '.join(self.kinds)}) for: {missing[:5]}")
