"""Writes an AWQ (GEMM) or GPTQ INT4 checkpoint with random packed values beside a float one, for
speed and memory benchmarks: a kernel's time and a layer's bytes do not depend on the values, and
random codes need no calibration pass over a multi-GB model. (Accuracy is checked by the tests,
whose packer quantizes real weights: tests/unit/engine/int4_packer.py.)

Every ``q/k/v/o/gate/up/down_proj.weight [out, in]`` of the float checkpoint becomes the packed
tensors of the format (shapes as AutoAWQ / AutoGPTQ publish them; see
``gpu_workers/engine/quantization/int4_formats.py``); every other tensor is copied; config.json
gains the ``quantization_config``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_SCALE = 0.002  # typical magnitude of a 4-bit step for weights of std ~0.02


def _random_words(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31, shape, dtype=torch.int64, generator=gen).to(torch.int32)


def _packed(out_f: int, in_f: int, method: str, group_size: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    groups = in_f // group_size
    scales = (torch.rand(groups, out_f, generator=gen) * _SCALE + _SCALE / 2).half()
    # Zero points of 8 (every nibble 8, or 7 in GPTQ v1, which stores zero - 1) keep values centred.
    if method == "awq":
        qzeros = torch.full((groups, out_f // 8), 0x88888888 - 2**32, dtype=torch.int32)
        return {"qweight": _random_words((in_f, out_f // 8), gen), "qzeros": qzeros, "scales": scales}
    qzeros = torch.full((groups, out_f // 8), 0x77777777, dtype=torch.int32)
    g_idx = (torch.arange(in_f) // group_size).to(torch.int32)
    return {"qweight": _random_words((in_f // 8, out_f), gen), "qzeros": qzeros, "scales": scales, "g_idx": g_idx}


def write_random_int4(src: Path, dst: Path, method: str, group_size: int = 128, seed: int = 0) -> Path:
    """``src`` float folder -> ``dst`` INT4 folder (``method`` "awq" or "gptq"); returns ``dst``."""
    if method not in ("awq", "gptq"):
        raise ValueError(f"method must be 'awq' or 'gptq', got {method!r}")
    dst.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    files = sorted(src.glob("*.safetensors"))
    for file in files:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                parts = name.rsplit(".", 2)
                if len(parts) == 3 and parts[1] in _PROJECTIONS and parts[2] == "weight":
                    out_f, in_f = f.get_slice(name).get_shape()
                    pieces = _packed(out_f, in_f, method, group_size, gen)
                    out.update({f"{parts[0]}.{parts[1]}.{kind}": t for kind, t in pieces.items()})
                else:
                    out[name] = f.get_tensor(name)
        save_file(out, str(dst / file.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, file.name))
    for item in src.iterdir():
        if item.suffix != ".safetensors" and item.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(item, dst / item.name)
    if len(files) > 1:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    if method == "awq":
        qcfg = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    else:
        qcfg = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": True}
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": qcfg}, indent=2))
    return dst
