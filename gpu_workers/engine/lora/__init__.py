"""Multi-LoRA serving: one engine step may mix requests of several adapters and of the base model.

``batch`` holds the per-step token-to-slot map (:class:`LoRABatch`); ``kernels`` :func:`add_lora`, the batched
``y += scale * x A^T B^T`` over slot-stacked adapter weights (``triton_lora`` on CUDA, torch elsewhere).
``request`` the adapter value callers pass (:class:`LoRARequest`); ``peft_files`` checks and reads PEFT adapter
folders; ``layers`` the LoRA-wrapped projections; ``slots`` the device slots; ``manager`` the CPU pool and the
engine's hooks (scheduler admission, model runner).
"""

from .batch import LoRABatch
from .kernels import add_lora
from .peft_files import AdapterSpec, LoRAError, check_adapter
from .request import LoRARequest

__all__ = ["AdapterSpec", "LoRABatch", "LoRAError", "LoRARequest", "add_lora", "check_adapter"]
