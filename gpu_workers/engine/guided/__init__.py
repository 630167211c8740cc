"""Guided (constrained) decoding: what a request asks for (``GuidedDecoding``), grammars compiled once per
(constraint, tokenizer) and per-request matchers whose token bitmasks the sampler applies."""

from .params import GuidedDecoding

__all__ = ["GuidedDecoding"]
