"""Sluicegate's inference engine: continuous batching over a paged KV cache with prefix caching.

Offline: ``LLM(model=...).generate(prompts, SamplingParams(...))``. Online: ``AsyncEngine``, whose
``generate`` streams ``RequestDelta``s. Imports only torch, transformers, safetensors and tokenizers
(optional GPU packages are imported lazily).

Layout: ``entrypoints/`` the front ends (``LLM``, ``AsyncEngine``, ``ProcessEngine`` on ``EngineFront``);
``llm_engine.py`` the loop they drive (``LLMEngine``); ``core/`` the state and bookkeeping it steps (scheduler,
KV block manager, request and sequence state, admission, deltas); ``execution/`` the forward pass and sampling;
``attention/``, ``models/``, ``quantization/`` the kernels, architectures and quantized layers. Everything outside
the engine imports from this package.
"""

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .entrypoints.async_engine import AsyncEngine
from .entrypoints.engine_front import EngineFront, RequestStream
from .entrypoints.llm import LLM
from .entrypoints.process_engine import ProcessEngine
from .guided import GuidedDecoding
from .llm_engine import LLMEngine
from .lora import LoRAError, LoRARequest
from .outputs import EngineStats, RequestDelta, RequestMetrics, RequestOutput, TokenLogprob
from .sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "EngineConfig",
    "EngineFront",
    "EngineStats",
    "GuidedDecoding",
    "IncrementalDetokenizer",
    "LLMEngine",
    "LoRAError",
    "LoRARequest",
    "ProcessEngine",
    "RequestDelta",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "TokenLogprob",
]
