"""Test-only packer: turns a float Hugging Face folder into an AutoAWQ (GEMM) or GPTQ INT4 folder,
written as those tools publish them, plus the matching "dequantized" float folder as a reference.

Written from the published formats, independently of the engine's unpacking code, so loading
these folders checks the engine against the formats rather than against itself:

- group quantization of each projection weight ``W [out, in]`` over groups of ``group_size``
  input rows: asymmetric (AWQ, GPTQ ``sym=false``: min/max over the group, with 0 inside the
  range as GPTQ does) or symmetric (GPTQ ``sym=true``: zero point 8); scales stored as fp16;
- AWQ GEMM: ``qweight [in, out/8]`` and ``qzeros [groups, out/8]`` int32, eight outputs per word
  in the order 0, 2, 4, 6, 1, 3, 5, 7; ``scales [groups, out]``;
- GPTQ: ``qweight [in/8, out]`` (eight inputs per word, in order), ``qzeros [groups, out/8]``
  (eight outputs per word, in order, each zero minus one in the v1 ``gptq`` format),
  ``scales [groups, out]``, ``g_idx [in]``; with act-order (``desc_act``) the inputs are taken
  in a permuted order when forming groups, and ``g_idx`` maps each input to its group.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class GroupQuant:
    """Integer codes and per-group parameters of one weight ``[out, in]``."""

    codes: torch.Tensor  # int64 [out, in] in 0..15
    zeros: torch.Tensor  # int64 [groups, out]
    scales: torch.Tensor  # fp16 [groups, out]
    g_idx: torch.Tensor  # int32 [in]

    def dequantize(self) -> torch.Tensor:
        """Float32 ``[out, in]``: (code - zero) * scale of each input's group."""
        g = self.g_idx.long()
        return (self.codes - self.zeros[g].t()).float() * self.scales[g].t().float()


def quantize_groups(weight: torch.Tensor, group_size: int, sym: bool, order: torch.Tensor | None) -> GroupQuant:
    """Round ``weight [out, in]`` to 4-bit codes per group of inputs (taken in ``order`` if given)."""
    out_f, in_f = weight.shape
    group_size = in_f if group_size == -1 else group_size
    order = torch.arange(in_f) if order is None else order
    g_idx = torch.empty(in_f, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_f) // group_size).to(torch.int32)
    w = weight.float()
    groups = in_f // group_size
    scales = torch.empty(groups, out_f)
    zeros = torch.empty(groups, out_f, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, order[g * group_size : (g + 1) * group_size]]
        lo = cols.min(dim=1).values.clamp(max=0.0)
        hi = cols.max(dim=1).values.clamp(min=0.0)
        if sym:
            hi = torch.maximum(hi, -lo)
            lo = -hi
        scale = ((hi - lo) / 15).clamp(min=1e-6).half().float()
        scales[g] = scale
        zeros[g] = torch.full_like(zeros[g], 8) if sym else torch.round(-lo / scale).clamp(0, 15).long()
    g = g_idx.long()
    codes = torch.round(w / scales[g].t()) + zeros[g].t()
    return GroupQuant(codes.clamp(0, 15).long(), zeros, scales.half(), g_idx)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack_last_dim(values: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int64 ``[R, C]`` -> int32 ``[R, C/8]``: nibble ``i`` of word ``c`` holds column ``8c + order[i]``."""
    rows, cols = values.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for i, src in enumerate(order):
        words |= (values[:, src::8] & 0xF) << (4 * i)
    return _to_int32(words)


def pack_awq(q: GroupQuant) -> dict[str, torch.Tensor]:
    return {
        "qweight": _pack_last_dim(q.codes.t().contiguous(), AWQ_PACK_ORDER),
        "qzeros": _pack_last_dim(q.zeros, AWQ_PACK_ORDER),
        "scales": q.scales,
    }


def pack_gptq(q: GroupQuant, zero_offset: int = 1) -> dict[str, torch.Tensor]:
    codes = q.codes.t().contiguous()  # [in, out]
    words = torch.zeros(codes.shape[0] // 8, codes.shape[1], dtype=torch.int64)
    for i in range(8):
        words |= codes[i::8] << (4 * i)
    return {
        "qweight": _to_int32(words),
        "qzeros": _pack_last_dim(q.zeros - zero_offset, tuple(range(8))),
        "scales": q.scales,
        "g_idx": q.g_idx,
    }


def _read(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def _copy_folder(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.suffix != ".safetensors" and item.name != "model.safetensors.index.json":
            shutil.copy(item, dst / item.name)


def write_int4_checkpoint(
    src: Path,
    dst: Path,
    method: str,
    *,
    group_size: int = 32,
    sym: bool = False,
    desc_act: bool = False,
    checkpoint_format: str = "gptq",
    seed: int = 0,
) -> tuple[Path, Path]:
    """Write ``dst/int4`` (the packed checkpoint) and ``dst/dequant`` (float32 weights equal to what
    the INT4 values stand for) from the float folder ``src``; returns both paths."""
    tensors = _read(src)
    packed: dict[str, torch.Tensor] = {}
    dequant: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(seed)
    orders: dict[str, torch.Tensor] = {}  # act-order per (layer, input): q/k/v and gate/up share one
    zero_offset = 1 if checkpoint_format == "gptq" else 0
    for name, tensor in tensors.items():
        parts = name.rsplit(".", 2)
        if len(parts) != 3 or parts[1] not in PROJECTIONS or parts[2] != "weight":
            packed[name] = dequant[name] = tensor
            continue
        prefix, proj = parts[0].rsplit(".", 1)[0], parts[1]
        order = None
        if desc_act:
            key = f"{prefix}.{'qkv' if proj in ('q_proj', 'k_proj', 'v_proj') else proj}"
            key = key.replace("up_proj", "gate_proj")
            order = orders.setdefault(key, torch.randperm(tensor.shape[1], generator=gen))
        q = quantize_groups(tensor, group_size, sym=sym, order=order)
        base = name.removesuffix(".weight")
        pieces = pack_awq(q) if method == "awq" else pack_gptq(q, zero_offset)
        packed.update({f"{base}.{kind}": t for kind, t in pieces.items()})
        dequant[name] = q.dequantize()
    config = json.loads((src / "config.json").read_text())
    if method == "awq":
        qcfg = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    else:
        qcfg = {
            "quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": checkpoint_format,
        }  # fmt: skip
    out_int4, out_ref = dst / "int4", dst / "dequant"
    for folder, weights in ((out_int4, packed), (out_ref, dequant)):
        _copy_folder(src, folder)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    (out_int4 / "config.json").write_text(json.dumps({**config, "quantization_config": qcfg}, indent=2))
    return out_int4, out_ref
