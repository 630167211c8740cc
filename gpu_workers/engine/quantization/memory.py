"""Weight memory accounting that sees quantised storage: parameters and buffers plus the scale
tensors bitsandbytes keeps outside them (int8 row scales, NF4 block absmax and code tables).

Each storage is counted once, so tied weights (embedding = LM head) and views are not double counted. A module
whose weights live outside tensors (fbgemm's packed int8, ``cpu_w8a8.py``) says how many bytes in ``packed_bytes``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def _quant_state_tensors(state: object) -> Iterator[torch.Tensor]:
    """Tensors held by a bitsandbytes 4-bit ``QuantState`` (and its nested state, if any)."""
    for attr in ("absmax", "code", "offset"):
        t = getattr(state, attr, None)
        if isinstance(t, torch.Tensor):
            yield t
    nested = getattr(state, "state2", None)
    if nested is not None:
        yield from _quant_state_tensors(nested)


def _side_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """Quantisation tensors a module holds as plain attributes rather than parameters or buffers."""
    weight = getattr(module, "weight", None)
    # Int8Params keeps CB (the int8 data itself) and SCB (per-row scales) as attributes until the
    # first forward, after which Linear8bitLt moves them onto its MatmulLtState.
    for holder in (weight, getattr(module, "state", None)):
        for attr in ("CB", "SCB"):
            t = getattr(holder, attr, None)
            if isinstance(t, torch.Tensor):
                yield t
    for state in (getattr(weight, "quant_state", None), getattr(module, "quant_state", None)):
        if state is not None and not isinstance(state, torch.Tensor):
            yield from _quant_state_tensors(state)


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    if t.device.type == "meta":
        return None
    return str(t.device), t.untyped_storage().data_ptr()


def weight_memory_bytes(model: nn.Module) -> int:
    """Bytes of device memory held by ``model``'s parameters, buffers and quantisation side tensors."""
    seen: dict[tuple[str, int], int] = {}
    unkeyed = 0
    for module in model.modules():
        tensors = [
            *module.parameters(recurse=False),
            *module.buffers(recurse=False),
            *_side_tensors(module),
        ]
        for t in tensors:
            key = _storage_key(t)
            if key is None:
                unkeyed += t.numel() * t.element_size()
                continue
            # A view may not cover its whole storage; the storage is what occupies memory.
            seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        unkeyed += int(getattr(module, "packed_bytes", 0))
    return sum(seen.values()) + unkeyed
