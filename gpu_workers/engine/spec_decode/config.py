"""``SpeculativeConfig``: which proposer drafts tokens and how many per step (vLLM's ``speculative_config``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KNOWN_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method="ngram"``: prompt lookup, drafting the tokens that followed the latest earlier occurrence of the
    last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens of prompt + output. ``method="draft_model"``: a
    smaller model of the target's tokenizer (``model``, a Hugging Face folder) drafts them (``draft_model.py``)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in KNOWN_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of {', '.join(KNOWN_METHODS)}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs model: the draft model's folder")
        if self.method == "ngram" and self.model:
            # A model given to the n-gram method would be silently unused: most likely a mistyped method.
            raise ValueError(f"speculative method 'ngram' takes no model (got {self.model!r}); use 'draft_model'")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"speculative {name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )

    @classmethod
    def from_value(cls, value: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """Accept a ``SpeculativeConfig``, a dict of its fields (as vLLM takes it), or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict or SpeculativeConfig, got {value!r}")
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {', '.join(sorted(unknown))}")
        return cls(**value)
