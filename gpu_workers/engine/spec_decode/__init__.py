"""Speculative decoding: draft proposers (``ngram``), the verification of drafts against the target's logits
(``rejection``), and their settings (``config``)."""

from .config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
