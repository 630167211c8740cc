"""Per-request decoding parameters (vLLM-style), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from .guided import GuidedDecoding

#: The most top-logprob alternatives a request may ask for (OpenAI's and vLLM's default cap).
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` means greedy decoding (argmax). ``top_k <= 0`` and ``top_p == 1`` disable
    those filters. ``max_tokens=None`` generates up to the model's context length. ``stop`` strings
    end generation with the text cut right before the match; ``stop_token_ids`` and EOS end it with
    the token kept in ``token_ids`` (and hidden from ``text`` if it is a special token).
    ``seed`` keys the request's random draws by position (``core/counter_rng.py``), so its tokens repeat run
    after run, whatever else is batched with it, and across a resume on another worker.

    Penalties follow vLLM: ``presence_penalty`` / ``frequency_penalty`` (OpenAI semantics, over the
    generated tokens, each in [-2, 2]), ``repetition_penalty`` (Hugging Face semantics, over prompt +
    generated tokens, > 0; 1 is off), then ``logit_bias`` (token id -> bias in [-100, 100]); ``min_p``
    ([0, 1]) drops tokens whose probability is below ``min_p`` times the top token's.

    ``logprobs``: None for none; ``k >= 0`` (at most 20) returns each generated token's logprob plus
    the top ``k`` alternatives, taken from the log-softmax of the model's RAW logits (before penalties,
    logit_bias, temperature and top-k/top-p/min-p), which is vLLM's default (``raw_logprobs``).

    ``n`` choices share the prompt's KV blocks (one prefill); with a ``seed``, choice ``i`` samples
    from draws keyed by its own seed ``seed + i``. ``guided`` constrains the output to a grammar.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    n: int = 1
    guided: GuidedDecoding | None = None
    stop_list: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.temperature = float(self.temperature)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise ValueError(f"top_p must be a number, got {self.top_p!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_p = float(self.top_p)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an int, got {self.top_k!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
                raise ValueError(f"max_tokens must be an int or None, got {self.max_tokens!r}")
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.stop is None:
            self.stop_list = []
        elif isinstance(self.stop, str):
            self.stop_list = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            self.stop_list = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop_list):
            raise ValueError("stop strings must not be empty")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        else:
            self.stop_token_ids = list(self.stop_token_ids)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        self._validate_extras()

    def _validate_extras(self) -> None:
        """Penalties, min_p, logit_bias, logprobs, n and guided decoding (vLLM's names and ranges)."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        self.min_p = _number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            bias: dict[int, float] = {}
            for token, value in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
                value = _number(f"logit_bias[{token}]", value)
                if not -100.0 <= value <= 100.0:
                    raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {value}")
                bias[token] = value
            self.logit_bias = bias or None
        if self.logprobs is not None:
            if isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int):
                raise ValueError(f"logprobs must be an int or None, got {self.logprobs!r}")
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.guided is not None and not isinstance(self.guided, GuidedDecoding):
            raise ValueError(f"guided must be a GuidedDecoding, got {type(self.guided).__name__}")

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler must apply penalties or logit_bias to this request's row. ``min_p`` is not one:
        it is part of the distribution the row samples from (``Sampler.target_probs``), which speculative
        verification uses as it is, while penalties depend on the tokens before each position."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.logit_bias is not None
        )

    @property
    def greedy(self) -> bool:
        """Greedy (argmax) decoding; temperature 0 skips the random path entirely."""
        return self.temperature == 0.0

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop_list), default=0)


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)
