"""Request bodies of the OpenAI-compatible and native endpoints: what each accepts and how it is checked
(:func:`sluicegate.api.build.build_request` turns one into the pipeline's :class:`schemas.InferenceRequest`).

OpenAI fields Sluicegate does not implement (``functions``, ``audio``, ``echo``...) are rejected with a
400 naming them instead of being ignored; fields that change nothing (``user``, ``metadata``...) are
accepted. vLLM-style extras (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``) and ``priority`` are accepted on every endpoint. ``response_format`` and a forced
``tool_choice`` become a :class:`schemas.GuidedSpec` (:mod:`sluicegate.api.tool_calls` builds the tool-call schema).
"""

from .base import DEFAULT_COMPLETION_MAX_TOKENS, DEFAULT_MAX_TOKENS, StreamOptions
from .chat import ChatCompletionBody
from .completion import MAX_COMPLETION_PROMPTS, SEVERAL_PROMPTS, CompletionBody
from .embedding import EmbeddingInput
from .native import NativeRequestBody

AnyBody = ChatCompletionBody | CompletionBody | NativeRequestBody | EmbeddingInput

__all__ = [
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "DEFAULT_MAX_TOKENS",
    "MAX_COMPLETION_PROMPTS",
    "SEVERAL_PROMPTS",
    "AnyBody",
    "ChatCompletionBody",
    "CompletionBody",
    "EmbeddingInput",
    "NativeRequestBody",
    "StreamOptions",
]
