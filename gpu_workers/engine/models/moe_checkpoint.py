"""Where a checkpoint's expert tensors go in the stacked expert parameters of ``moe.SparseMoeBlock``.

The loader (``loader.load_weights``) asks ``expert_slot`` about each checkpoint name before its own merged-projection
names. Three layouts load:

* per expert, as hub checkpoints and transformers' ``save_pretrained`` write them: Mixtral's
  ``block_sparse_moe.experts.N.w1 / w3 / w2`` (gate / up / down) and router ``block_sparse_moe.gate``, Qwen3-MoE's
  ``mlp.experts.N.gate_proj / up_proj / down_proj``;
* stacked per projection, ``mlp.experts.gate_proj.weight`` / ``up_proj.weight`` ``[E, I, H]`` and
  ``down_proj.weight`` ``[E, H, I]``, as a GGUF holds them (``ffn_*_exps``, written so by ``gguf_convert.py``);
* fused, ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``, transformers'
  in-memory names (``save_pretrained(save_original_format=False)``): these are the parameters' own names, so the
  loader copies them whole, with no slot.

A slot counts as shards of its parameter (gate of expert e = ``2e``, up = ``2e + 1``, down = ``e``), so the loader's
check for gaps and doubles covers every expert of every layer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_PER_EXPERT = re.compile(
    r"^(?P<prefix>.+)\.(?:block_sparse_moe|mlp)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_STACKED = re.compile(r"^(?P<prefix>.+)\.mlp\.experts\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_ROUTER = re.compile(r"^(?P<prefix>.+)\.block_sparse_moe\.gate\.weight$")
# Mixtral's w1 / w3 / w2 are gate / up / down.
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_GATE_UP, _DOWN = "experts.gate_up_proj", "experts.down_proj"


@dataclass(frozen=True)
class ExpertSlot:
    """A checkpoint tensor's place: ``param`` (a model parameter name), ``index`` into it, the shards it fills."""

    param: str
    index: tuple[int | slice, ...]
    shards: tuple[int, ...]


def expert_shards(param_name: str, param: torch.Tensor) -> range | None:
    """The shards a stacked expert parameter is filled in (None for any other parameter)."""
    if param_name.endswith("." + _GATE_UP):
        return range(2 * param.shape[0])
    if param_name.endswith("." + _DOWN):
        return range(param.shape[0])
    return None


def router_name(ckpt_name: str) -> str | None:
    """Mixtral's ``block_sparse_moe.gate.weight`` under this engine's ``mlp.gate.weight``; None for other names."""
    match = _ROUTER.match(ckpt_name)
    return None if match is None else f"{match['prefix']}.mlp.gate.weight"


def expert_slot(ckpt_name: str, params: dict[str, torch.nn.Parameter]) -> ExpertSlot | None:
    """Where the per-expert or per-projection stacked tensor ``ckpt_name`` goes; None for any other name (or for a
    name whose layer has no experts in this model: the loader then reports it as unused)."""
    match = _PER_EXPERT.match(ckpt_name) or _STACKED.match(ckpt_name)
    if match is None:
        return None
    proj = _PROJ.get(match["proj"], match["proj"])
    target = f"{match['prefix']}.mlp.{_DOWN if proj == 'down_proj' else _GATE_UP}"
    param = params.get(target)
    if param is None:
        return None
    num_experts = param.shape[0]
    inter = param.shape[1] // 2 if proj != "down_proj" else param.shape[2]
    expert = match.groupdict().get("expert")
    experts = [int(expert)] if expert is not None else list(range(num_experts))
    if experts[-1] >= num_experts:
        raise ValueError(f"checkpoint tensor {ckpt_name} names expert {experts[-1]} of a {num_experts}-expert layer")
    which: int | slice = int(expert) if expert is not None else slice(None)
    if proj == "down_proj":
        return ExpertSlot(target, (which,), tuple(experts))
    half = 0 if proj == "gate_proj" else 1
    rows = slice(half * inter, (half + 1) * inter)
    return ExpertSlot(target, (which, rows), tuple(2 * e + half for e in experts))
