"""Multi-LoRA serving: one engine step may mix requests of several adapters and of the base model.

``kernels`` holds the per-step token-to-slot map (:class:`LoRABatch`) and :func:`add_lora`, the
batched ``y += scale * x A^T B^T`` over slot-stacked adapter weights (Triton on CUDA, torch elsewhere).
"""

from .kernels import LoRABatch, add_lora

__all__ = ["LoRABatch", "add_lora"]
