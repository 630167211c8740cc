"""Sluicegate's inference engine: continuous batching over a paged KV cache with prefix caching.

Offline: ``LLM(model=...).generate(prompts, SamplingParams(...))``. Online: ``AsyncEngine``, whose
``generate`` streams ``RequestDelta``s. Imports only torch, transformers, safetensors and tokenizers
(optional GPU packages are imported lazily).
"""

from .async_engine import AsyncEngine, RequestStream
from .config import EngineConfig
from .engine_core import LLMEngine
from .llm import LLM
from .outputs import EngineStats, RequestDelta, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .tiny_model import make_tiny_model

__all__ = [
    "LLM",
    "AsyncEngine",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "RequestDelta",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "make_tiny_model",
]
