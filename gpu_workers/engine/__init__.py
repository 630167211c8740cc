"""Sluicegate's inference engine: continuous batching over a paged KV cache with prefix caching.

Offline: ``LLM(model=...).generate(prompts, SamplingParams(...))``. Online: ``AsyncEngine``, whose
``generate`` streams ``RequestDelta``s. Imports only torch, transformers, safetensors and tokenizers
(optional GPU packages are imported lazily).
"""

from .config import EngineConfig
from .core.llm_engine import LLMEngine
from .detokenizer import IncrementalDetokenizer
from .entrypoints.async_engine import AsyncEngine
from .entrypoints.engine_front import EngineFront, RequestStream
from .entrypoints.llm import LLM
from .entrypoints.process_engine import ProcessEngine
from .outputs import EngineStats, RequestDelta, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "EngineConfig",
    "EngineFront",
    "EngineStats",
    "IncrementalDetokenizer",
    "LLMEngine",
    "ProcessEngine",
    "RequestDelta",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
]
