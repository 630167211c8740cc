"""Picks the next token for every sampling row: greedy, or temperature + min-p + top-k + top-p sampling.

Order (vLLM's): raw logprobs are captured first; then min_tokens bans, the grammar bitmask, logit_bias,
repetition / frequency / presence penalties; greedy rows take the argmax; random rows divide by the
temperature, apply min_p, then top-k / top-p. Every step is batched over the rows that need it, so a
batch without penalties, logprobs or grammars runs exactly the plain path.

Random rows draw through the exponential-race trick (``argmax(p / q)`` with ``q ~ Exp(1)`` equals
sampling from ``p``), which lets each seeded choice take its own noise while the arithmetic stays
batched. A seeded choice's noise is keyed by the position it samples (``core/counter_rng.py``), so it is the
same whatever the batch, and after a resume on another worker; unseeded rows share the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..core.counter_rng import Stream
from ..core.sequence import Sequence
from ..outputs import TokenLogprob
from .logprobs import RawLogprobs
from .penalties import apply_bias_and_penalties, apply_min_p


class TokenMask(Protocol):
    """Forbids tokens per row (guided decoding's ``TokenBitmask``): sets their logits to -inf in place."""

    def apply(self, logits: torch.Tensor) -> None: ...


@dataclass
class SamplerOutput:
    """One token per row, and per row its ``TokenLogprob`` (None where not asked; the list is None when no
    row asked)."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None] | None = None


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], token_mask: TokenMask | None = None
    ) -> SamplerOutput:
        """``logits`` is float32 ``[len(seqs), vocab]``; ``token_mask`` (the batch's grammar bitmask) sets the
        logits its grammars forbid to -inf. Returns one token id per row (and logprobs where asked)."""
        raw = RawLogprobs.capture(logits, [s.params.logprobs for s in seqs])
        tokens = self._pick(logits, seqs, token_mask)
        return SamplerOutput(tokens, raw.resolve(tokens, len(seqs)) if raw is not None else None)

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence], token_mask: TokenMask | None) -> list[int]:
        self._suppress_early_stops(logits, seqs)
        if token_mask is not None:
            token_mask.apply(logits)
        if any(s.params.has_penalties for s in seqs):
            apply_bias_and_penalties(logits, seqs)
        greedy_rows = [i for i, s in enumerate(seqs) if s.params.greedy]
        if len(greedy_rows) == len(seqs):
            return logits.argmax(dim=-1).tolist()
        tokens = torch.empty(len(seqs), dtype=torch.int64, device=logits.device)
        if greedy_rows:
            rows = torch.tensor(greedy_rows, device=logits.device)
            tokens[rows] = logits[rows].argmax(dim=-1)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        rows = torch.tensor(random_rows, device=logits.device)
        tokens[rows] = self._sample(logits[rows], [seqs[i] for i in random_rows])
        return tokens.tolist()

    @staticmethod
    def _suppress_early_stops(logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Below ``min_tokens``, EOS and stop ids must not be produced."""
        for i, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens:
                banned = set(seq.params.stop_token_ids or []) | set(seq.eos_token_ids)
                if banned:
                    logits[i, list(banned)] = float("-inf")

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        return self.draw(self.target_probs(logits, seqs), seqs)

    @staticmethod
    def target_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The distribution each random row samples from: temperature, min_p, then top-k / top-p, softmax."""
        dev = logits.device
        temps = torch.tensor([s.params.temperature for s in seqs], dtype=logits.dtype, device=dev)
        logits = logits / temps[:, None]
        min_ps = [s.params.min_p for s in seqs]
        if any(p > 0.0 for p in min_ps):
            logits = apply_min_p(logits, min_ps)
        top_ks = [s.params.top_k for s in seqs]
        top_ps = [s.params.top_p for s in seqs]
        if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
            logits = _apply_top_k_top_p(logits, top_ks, top_ps)
        return torch.softmax(logits, dim=-1)

    def draw(
        self,
        probs: torch.Tensor,
        seqs: list[Sequence],
        offsets: list[int] | None = None,
        stream: Stream = Stream.TOKEN,
    ) -> torch.Tensor:
        """One token per row of ``probs`` (unnormalised weights are fine), each seeded row's noise keyed by the
        position it samples (the sequence's next position plus the row's ``offsets`` entry: a draft model's
        later drafts), unseeded rows' from the engine's generator."""
        dev = probs.device
        noise = torch.empty_like(probs)
        shared = [i for i, s in enumerate(seqs) if s.rng is None]
        if shared:
            draw = torch.empty((len(shared), probs.shape[1]), dtype=probs.dtype, device=dev)
            draw.exponential_(generator=self.generator)
            noise[torch.tensor(shared, device=dev)] = draw
        for i, seq in enumerate(seqs):
            if seq.rng is not None:
                seq.rng.exponential_(noise[i], seq.num_tokens + (offsets[i] if offsets else 0), stream)
        return (probs / noise).argmax(dim=-1)

    def uniform(self, n: int, seq: Sequence) -> torch.Tensor:
        """``n`` draws from U[0, 1), one per draft position from the sequence's next one on (a seeded choice's
        keyed by position; the engine's generator when unseeded)."""
        if seq.rng is not None:
            return seq.rng.uniform([seq.num_tokens + j for j in range(n)]).to(self.device)
        return torch.rand(n, generator=self.generator, device=self.device)


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Mask to -inf every logit outside the row's top-k and outside its top-p nucleus."""
    vocab = logits.shape[-1]
    dev = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=dev)
    ranks = torch.arange(vocab, device=dev)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= ks[:, None], float("-inf"))
    if any(p < 1.0 for p in top_ps):
        ps = torch.tensor(top_ps, dtype=logits.dtype, device=dev)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        # Keep the smallest prefix of tokens whose mass reaches p (always at least the top token).
        sorted_logits = sorted_logits.masked_fill(mass_before >= ps[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
