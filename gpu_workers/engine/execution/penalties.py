"""Logit adjustments before sampling, batched over the rows that ask for them (vLLM's order and semantics).

``apply_bias_and_penalties``: logit_bias, then repetition (Hugging Face: over prompt + generated tokens,
positive logits divided, negative multiplied), frequency and presence (OpenAI: over generated tokens,
``logit -= frequency * count + presence * (count > 0)``). ``apply_min_p`` drops tokens whose probability
is below ``min_p`` times the row's top probability (after temperature). Per-row parameters are tensors
and token counts are built with one ``scatter_add`` per step: no Python loop over the vocabulary.
"""

from __future__ import annotations

import torch

from ..core.sequence import Sequence


def _padded(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` as one ``[len(rows), longest]`` int64 tensor plus a validity mask (padding is token 0)."""
    width = max((len(r) for r in rows), default=0) or 1
    ids = torch.zeros((len(rows), width), dtype=torch.int64)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
            valid[i, : len(r)] = True
    return ids.to(device), valid.to(device)


def _counts(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each row: ``[len(rows), vocab]`` float32."""
    ids, valid = _padded(rows, device)
    counts = torch.zeros((len(rows), vocab), dtype=torch.float32, device=device)
    # Out-of-vocabulary ids (a tokenizer larger than the model's head) cannot be penalised; drop them.
    valid &= ids < vocab
    counts.scatter_add_(1, ids.clamp(max=vocab - 1), valid.float())
    return counts


def apply_bias_and_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Adjust ``logits`` (``[len(seqs), vocab]``, float32) in place for every row with bias or penalties."""
    vocab = logits.shape[1]
    dev = logits.device
    bias_rows = [i for i, s in enumerate(seqs) if s.params.logit_bias]
    if bias_rows:
        rows, cols, values = [], [], []
        for i in bias_rows:
            for token, value in (seqs[i].params.logit_bias or {}).items():
                if token < vocab:
                    rows.append(i)
                    cols.append(token)
                    values.append(value)
        if rows:
            logits.index_put_(
                (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                torch.tensor(values, dtype=logits.dtype, device=dev),
                accumulate=True,
            )
    rep_rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    if rep_rows:
        index = torch.tensor(rep_rows, device=dev)
        seen = _counts([seqs[i].token_ids for i in rep_rows], vocab, dev) > 0
        penalty = torch.tensor([seqs[i].params.repetition_penalty for i in rep_rows], device=dev)[:, None]
        sub = logits[index]
        penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits[index] = torch.where(seen, penalised, sub)
    freq_rows = [i for i, s in enumerate(seqs) if s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0]
    if freq_rows:
        index = torch.tensor(freq_rows, device=dev)
        counts = _counts([seqs[i].output_token_ids for i in freq_rows], vocab, dev)
        freq = torch.tensor([seqs[i].params.frequency_penalty for i in freq_rows], device=dev)[:, None]
        presence = torch.tensor([seqs[i].params.presence_penalty for i in freq_rows], device=dev)[:, None]
        logits[index] -= freq * counts + presence * (counts > 0).float()


def apply_min_p(logits: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """Mask to -inf the tokens below ``min_p`` times the row's top probability (rows with 0 unchanged)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = (
        probs.amax(dim=-1, keepdim=True) * torch.tensor(min_ps, dtype=logits.dtype, device=logits.device)[:, None]
    )
    return logits.masked_fill(probs < threshold, float("-inf"))
