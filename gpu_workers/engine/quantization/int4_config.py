"""Reads the ``quantization_config`` of an INT4 checkpoint (AutoAWQ GEMM or GPTQ) from a model's
``config.json`` into one validated ``Int4Config``, refusing what the INT4 layer cannot run.

Supported: 4-bit AWQ in the GEMM layout with zero points, and 4-bit GPTQ (``checkpoint_format``
``gptq`` or ``gptq_v2``, symmetric or asymmetric, with or without act-order). Everything else
(other bit widths, the GEMV / Marlin / ExLlama-only layouts, quantized LM heads, partially
converted models) gets a ``ValueError`` that names the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

INT4_METHODS: tuple[str, ...] = ("awq", "gptq")

Int4Method = Literal["awq", "gptq"]


@dataclass(frozen=True)
class Int4Config:
    """What the loader and ``Int4Linear`` need to know about an INT4 checkpoint."""

    method: Int4Method
    # Input rows sharing one scale and zero point; None: one group over the whole input (GPTQ -1).
    group_size: int | None
    # GPTQ act-order: rows are grouped by ``g_idx`` rather than by position.
    desc_act: bool = False
    # GPTQ v1 ("gptq") stores each zero point minus one; v2 stores it as is; AWQ as is.
    zero_offset: int = 0


def _field(raw: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if name in raw and raw[name] is not None:
            return raw[name]
    return default


def _group_size(raw: dict[str, Any], method: str) -> int | None:
    group = _field(raw, "group_size", "q_group_size", default=128)
    if not isinstance(group, int) or isinstance(group, bool) or (group <= 0 and group != -1):
        raise ValueError(f"{method} quantization_config group_size must be a positive int or -1, got {group!r}")
    if group == -1:
        if method == "awq":
            raise ValueError("awq quantization_config group_size=-1 is not supported (AWQ checkpoints are grouped)")
        return None
    if group % 8:
        raise ValueError(f"{method} quantization_config group_size must be a multiple of 8, got {group}")
    return group


def _refuse_partial(raw: dict[str, Any], method: str) -> None:
    skipped = _field(raw, "modules_to_not_convert", default=[])
    if skipped:
        raise ValueError(
            f"{method} checkpoints with modules_to_not_convert={skipped!r} are not supported "
            "(every projection must be quantized)"
        )
    if _field(raw, "lm_head", default=False):
        raise ValueError(f"{method} checkpoints with a quantized lm_head are not supported")


def parse_int4_config(raw: dict[str, Any]) -> Int4Config:
    """``quantization_config`` (a dict, as in config.json) -> ``Int4Config``, or a clear ValueError."""
    if not isinstance(raw, dict):
        raise ValueError(f"quantization_config must be a mapping, got {type(raw).__name__}")
    method = str(_field(raw, "quant_method", default="")).lower()
    if method not in INT4_METHODS:
        raise ValueError(
            f"quantization_config quant_method {method!r} is not an INT4 method ({', '.join(INT4_METHODS)})"
        )
    bits = _field(raw, "bits", "w_bit", default=4)
    if bits != 4:
        raise ValueError(f"{method} checkpoints with bits={bits!r} are not supported (only 4-bit)")
    _refuse_partial(raw, method)
    group = _group_size(raw, method)
    if method == "awq":
        version = str(_field(raw, "version", default="gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"awq version {version!r} is not supported: only the GEMM layout (AutoAWQ version='gemm'); "
                "GEMV, Marlin and ExLlama layouts pack weights differently"
            )
        if not _field(raw, "zero_point", default=True):
            raise ValueError("awq checkpoints with zero_point=false are not supported (only asymmetric AWQ)")
        return Int4Config(method="awq", group_size=group)
    fmt = str(_field(raw, "checkpoint_format", default="gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"gptq checkpoint_format {fmt!r} is not supported (only 'gptq' and 'gptq_v2'; "
            "Marlin/ExLlama-repacked checkpoints need their own kernels)"
        )
    # A symmetric checkpoint simply stores the mid-point (8) as every zero: no separate code path.
    return Int4Config(
        method="gptq",
        group_size=group,
        desc_act=bool(_field(raw, "desc_act", default=False)),
        zero_offset=1 if fmt == "gptq" else 0,
    )


def checkpoint_int4_config(hf_config: object) -> Int4Config | None:
    """The INT4 config of a loaded HF config; None for a float checkpoint or another method
    (an FP8 checkpoint's config, say, is left to the code that reads its KV-cache scales)."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else vars(raw)
    method = str(raw.get("quant_method", "")).lower()
    if method not in INT4_METHODS:
        return None
    return parse_int4_config(raw)
