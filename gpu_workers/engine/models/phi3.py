"""Phi-3, Phi-3.5, Phi-4 and Phi-4-mini (``Phi3ForCausalLM``): the Llama layout with its checkpoint's
projections already fused and its own RoPE variants.

What differs from Llama, and where it is handled:

- ``qkv_proj`` / ``gate_up_proj`` arrive fused in the checkpoint, in the very layout of the engine's merged
  layers; the loader splits each into its parts by the config's sizes (``loader.py``), so tensor parallelism
  cuts every part as it does Llama's and the merged layer is filled as for any other model.
- LongRoPE scaling (``rope_type`` ``longrope``) and ``partial_rotary_factor`` (Phi-4-mini rotates 3/4 of each
  head) are general RoPE features: ``rotary.py``.
- ``sliding_window`` (Phi-3-mini-4k's 2047) is a real window on every layer, as Mistral's: transformers masks
  Phi-3's attention to it, so the engine does too and the context stays ``max_position_embeddings``; the
  long-context models' windows exceed their contexts.
- The chat template (``<|user|>...<|end|><|assistant|>``) and the ``<|end|>`` end-of-turn token come from the
  checkpoint's tokenizer files and generation config, as for any model.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from .llama import LlamaForCausalLM, uniform_windows


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 family: no projection biases, SiLU MLP, fused checkpoint projections, LongRoPE / partial rotary."""

    @classmethod
    def sliding_windows(cls, config: PretrainedConfig) -> list[int | None]:
        return uniform_windows(config)
