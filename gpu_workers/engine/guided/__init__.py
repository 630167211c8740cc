"""Guided (constrained) decoding: what a request asks for (``GuidedDecoding``), grammars compiled once per
(constraint, tokenizer) and per-request matchers whose token bitmasks the sampler applies."""

from .params import GuidedDecoding

# The compiler and matcher import xgrammar; they are loaded by the engine only (``guided.compiler``,
# ``guided.matcher``), so the parameters stay importable wherever SamplingParams is.
__all__ = ["GuidedDecoding"]
