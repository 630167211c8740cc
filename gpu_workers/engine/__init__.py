"""Sluicegate's inference engine: continuous batching over a paged KV cache with prefix caching.

Offline: ``LLM(model=...).generate(prompts, SamplingParams(...))``. Online: ``AsyncEngine``, whose
``generate`` streams ``RequestDelta``s. Imports only torch, transformers, safetensors and tokenizers
(optional GPU packages are imported lazily).
"""

from .async_engine import AsyncEngine, RequestStream
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .engine_core import LLMEngine
from .engine_process import ProcessEngine
from .llm import LLM
from .outputs import EngineStats, RequestDelta, RequestMetrics, RequestOutput
from .request_streams import EngineFront
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
