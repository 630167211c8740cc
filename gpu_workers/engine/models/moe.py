"""The sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks ``top_k`` experts per token, each
expert is a SiLU-gated MLP, and a token's output is the routing-weighted sum of its experts' outputs.

Routing is each family's own (transformers' ``MixtralTopKRouter`` / ``Qwen3MoeTopKRouter``): softmax over all
experts in float32, top-k, then the chosen weights renormalized to sum to one (Mixtral always; Qwen3-MoE only under
``norm_topk_prob``). Expert weights are stacked as transformers keeps them: ``experts.gate_up_proj`` ``[E, 2I, H]``
(gate rows then up rows) and ``experts.down_proj`` ``[E, H, I]``; ``moe_checkpoint.py`` fills them from per-expert
checkpoint tensors.

Two paths compute the experts. The torch path (CPU, and CUDA without Triton) groups the ``tokens x top_k`` slots
by expert (a stable sort by expert id), runs one gate/up and one down matmul per expert over its group, and adds
the weighted rows back into their tokens with one ``index_add_``; experts kept quantized on the CPU
(``quantization/cpu_experts.py``) go through the same grouping, each group's matmuls their expert's int4 / int8
kernel. The Triton path (``moe_triton.py``, on CUDA) does
each projection as one grouped-GEMM launch over every expert, with no device-to-host sync (CUDA graphs capture it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` -> (weights ``[T, top_k]`` float32, expert ids ``[T, top_k]`` int64)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


ExpertProjection = Callable[[int, torch.Tensor], torch.Tensor]  # (expert, its rows [n, in]) -> [n, out]


def experts_grouped(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    num_experts: int,
    gate_up: ExpertProjection,
    down: ExpertProjection,
) -> torch.Tensor:
    """``x [T, H]`` through the experts ``ids [T, k]`` chosen for each token, weighted by ``weights [T, k]``:
    slots sorted by expert, one ``gate_up`` and one ``down`` call per expert group (a float matmul, or a kept-
    quantized expert's kernel), ``index_add_`` back into the tokens."""
    top_k = ids.shape[1]
    flat_ids = ids.reshape(-1)
    # Stable, so a token's slots keep their order inside an expert's group, and the sum below adds each token's
    # experts in expert-id order, as transformers' per-expert loop does.
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    rows = x.index_select(0, token_of)
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        gate, up = gate_up(expert, rows[start:end]).chunk(2, dim=-1)
        out[start:end] = down(expert, F.silu(gate) * up)
        start = end
    # The weighting is in float32, as transformers' Mixtral multiplies by its float32 routing weights.
    weighted = (out.float() * weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, weighted)


def experts_torch(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The grouped experts over stacked float weights ``gate_up [E, 2I, H]`` and ``down [E, H, I]``."""
    return experts_grouped(
        x, weights, ids, gate_up.shape[0],
        lambda expert, rows: F.linear(rows, gate_up[expert]), lambda expert, rows: F.linear(rows, down[expert]),
    )  # fmt: skip


class MoEExperts(nn.Module):
    """The stacked expert weights, named as transformers names them (so its fused checkpoints load as they are)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoeBlock(nn.Module):
    """Router (``gate``, no bias) plus stacked experts; ``forward`` maps ``[T, H]`` to ``[T, H]``."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool, act: str
    ) -> None:
        super().__init__()
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and the {num_experts} experts")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.intermediate_size = intermediate_size
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = MoEExperts(num_experts, hidden_size, intermediate_size)

    @classmethod
    def for_mixtral(cls, config: PretrainedConfig) -> SparseMoeBlock:
        return cls(
            config.hidden_size, config.intermediate_size, config.num_local_experts, config.num_experts_per_tok,
            renormalize=True, act=getattr(config, "hidden_act", "silu"),
        )  # fmt: skip

    @classmethod
    def for_qwen3_moe(cls, config: PretrainedConfig) -> SparseMoeBlock:
        return cls(
            config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
            renormalize=bool(config.norm_topk_prob), act=getattr(config, "hidden_act", "silu"),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        experts = self.experts
        if not isinstance(experts, MoEExperts):  # kept quantized on the CPU (quantization/cpu_experts.py)
            return experts_grouped(x, weights, ids, self.num_experts, experts.gate_up, experts.down)
        gate_up, down = experts.gate_up_proj, experts.down_proj
        if x.is_cuda:
            from .moe_triton import experts_triton

            return experts_triton(x, gate_up, down, weights, ids)
        return experts_torch(x, gate_up, down, weights, ids)
