"""What one rank keeps of the model: its query heads, its KV heads (split when there are at least as many as
ranks, else each rank keeps the one its query heads read: replicated), its columns of the MLP's intermediate
size, and its range of the (padded) vocabulary. ``parallelize`` resizes a freshly built (meta) model to that
shard and swaps in the parallel layers; ``shard_tensor`` cuts each checkpoint tensor as the loader reads it,
so a rank never holds more than its shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from ..models.llama import LlamaForCausalLM, head_dim_of
from .group import TPGroup
from .layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding


@dataclass(frozen=True)
class TPShard:
    rank: int
    world_size: int
    head_dim: int
    q_heads: tuple[int, int]  # [start, end) of the query heads
    kv_heads: tuple[int, int]  # [start, end) of the KV heads
    inter: tuple[int, int]  # [start, end) of the intermediate columns
    vocab_start: int
    vocab_local: int
    vocab_size: int

    @classmethod
    def plan(cls, config: PretrainedConfig, rank: int, world_size: int) -> TPShard:
        """The shard of ``rank``; refuses a model whose heads or MLP do not divide over the ranks."""
        heads = int(config.num_attention_heads)
        kv = int(config.num_key_value_heads or heads)
        inter = int(config.intermediate_size)
        problems = []
        if heads % world_size:
            problems.append(f"num_attention_heads={heads}")
        if kv % world_size and world_size % kv:
            problems.append(f"num_key_value_heads={kv} (neither a multiple nor a divisor of it)")
        if inter % world_size:
            problems.append(f"intermediate_size={inter}")
        if problems:
            raise ValueError(f"tensor_parallel_size={world_size} does not divide {', '.join(problems)}")
        q_local = heads // world_size
        if kv >= world_size:
            kv_local = kv // world_size
            kv_range = (rank * kv_local, (rank + 1) * kv_local)
        else:
            # Fewer KV heads than ranks: each rank keeps (a copy of) the KV head its query heads belong to.
            head = rank * q_local // (heads // kv)
            kv_range = (head, head + 1)
        i_local = inter // world_size
        vocab = int(config.vocab_size)
        v_local = -(-vocab // world_size)
        return cls(
            rank=rank,
            world_size=world_size,
            head_dim=head_dim_of(config),
            q_heads=(rank * q_local, (rank + 1) * q_local),
            kv_heads=kv_range,
            inter=(rank * i_local, (rank + 1) * i_local),
            vocab_start=rank * v_local,
            vocab_local=v_local,
            vocab_size=vocab,
        )

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    def shard_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor ``name`` (whole for norms and biases added after a sum)."""
        hd = self.head_dim
        rows = None
        if ".q_proj." in name:
            rows = (self.q_heads[0] * hd, self.q_heads[1] * hd)
        elif ".k_proj." in name or ".v_proj." in name:
            rows = (self.kv_heads[0] * hd, self.kv_heads[1] * hd)
        elif ".gate_proj." in name or ".up_proj." in name:
            rows = self.inter
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            part = tensor[self.vocab_start : self.vocab_start + self.vocab_local]
            if part.shape[0] < self.vocab_local:  # the last rank's range runs past the vocabulary: zero rows
                pad = part.new_zeros((self.vocab_local - part.shape[0], *part.shape[1:]))
                part = torch.cat([part, pad])
            return part
        elif name.endswith(".o_proj.weight"):
            return tensor[:, self.q_heads[0] * hd : self.q_heads[1] * hd]
        elif name.endswith(".down_proj.weight"):
            return tensor[:, self.inter[0] : self.inter[1]]
        return tensor if rows is None else tensor[rows[0] : rows[1]]


def parallelize(model: LlamaForCausalLM, shard: TPShard, group: TPGroup) -> None:
    """Resize a just-built (meta) model to ``shard``: smaller column-parallel projections, row-parallel O and
    down projections, vocab-parallel embedding and LM head, and the attention's local head counts."""
    config = model.config
    hidden = int(config.hidden_size)
    hd = shard.head_dim
    q_local = shard.q_heads[1] - shard.q_heads[0]
    kv_local = shard.num_kv_heads
    i_local = shard.inter[1] - shard.inter[0]
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.num_heads, attn.num_kv_heads = q_local, kv_local
        attn.q_size, attn.kv_size = q_local * hd, kv_local * hd
        attn.qkv_proj = nn.Linear(hidden, attn.q_size + 2 * attn.kv_size, bias=attn.qkv_proj.bias is not None)
        attn.o_proj = RowParallelLinear(attn.q_size, hidden, attn.o_proj.bias is not None, group)
        mlp = layer.mlp
        mlp.intermediate_size = i_local
        mlp.gate_up_proj = nn.Linear(hidden, 2 * i_local, bias=mlp.gate_up_proj.bias is not None)
        mlp.down_proj = RowParallelLinear(i_local, hidden, mlp.down_proj.bias is not None, group)
    model.model.embed_tokens = VocabParallelEmbedding(shard.vocab_start, shard.vocab_local, hidden, group)
    model.lm_head = ParallelLMHead(shard.vocab_local, hidden, shard.vocab_size, group)  # type: ignore[assignment]
    if model.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
