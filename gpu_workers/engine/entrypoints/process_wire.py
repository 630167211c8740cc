"""The wire between ``ProcessEngine`` and its engine process: length-prefixed pickles over a Unix socket pair.

* front -> engine: ``("init", config, initializer)`` once, then ``("add", EngineRequest)``,
  ``("abort", request_id)``, ``("call", (call_id, method, args))`` (one of ``engine_front.ENGINE_CALLS``: the
  adapter calls, the KV snapshot) and ``("stop", None)``;
* engine -> front: ``("ready", EngineSpec)`` or ``("startup_failed", kind, message)``; then per step
  ``("deltas", [RequestDelta], EngineStats, KVCacheEvents | None)`` (the step's prefix-cache changes, when
  the engine journals them), ``("rejected", request_id, message)`` for an add the engine
  refuses, ``("answer", call_id, result, error)`` for a call (``error``: the exception it raised, or None),
  ``("failed", traceback)`` when the step loop dies, and ``("stopped", [RequestDelta], EngineStats)``
  as the answer to ``stop``.

Everything pickled here names classes of importable modules (never of a ``__main__``), so both ends can load it.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass, field
from typing import Any

from ..outputs import EngineStats

_HEADER = struct.Struct("!I")


@dataclass(frozen=True)
class EngineSpec:
    """What the front needs to know of the loaded model, sent once the engine is ready."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    attention_backend: str
    pid: int
    stats: EngineStats
    # Prompt tokens the model refuses, with the reason (``RequestValidator.refused_tokens``).
    refused_tokens: dict[int, str] = field(default_factory=dict)
    architecture: str = ""
    arithmetic: str = ""


def frame(message: tuple[Any, ...]) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def split_frames(buffer: bytearray) -> list[tuple[Any, ...]]:
    """Take every complete frame off the front of ``buffer``."""
    messages = []
    start = 0
    while len(buffer) - start >= _HEADER.size:
        (size,) = _HEADER.unpack_from(buffer, start)
        end = start + _HEADER.size + size
        if len(buffer) < end:
            break
        messages.append(pickle.loads(memoryview(buffer)[start + _HEADER.size : end]))
        start = end
    del buffer[:start]
    return messages
