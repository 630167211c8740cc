"""Tensor parallelism (Megatron-style), ``tensor_parallel_size`` > 1: one engine process per rank, each holding
its shard of every projection and its own paged KV cache over its KV heads, with the same block tables.

- ``group.py``: the ranks' process group (gloo on CPU, NCCL on GPUs) and its collectives;
- ``shard.py``: which slice of each checkpoint tensor a rank keeps, and the model surgery that swaps in
  ``layers.py``'s parallel modules (row-parallel O and down projections with one all-reduce each,
  vocab-parallel embedding and LM head);
- ``ranks.py``: rank 0's model runner, which sends each step's plan (metadata only) to the other ranks
  before running its own shard, and the loop those ranks run; starting and stopping them.
"""
