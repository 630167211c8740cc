"""The random draws of a seeded choice as a pure function of where they are used, not of how it got there.

A stateful generator per choice (the old scheme) makes a choice's draws depend on its history: a request
resumed on another worker after a crash gets a fresh generator and continues differently from a clean run, and
any change in how many draws came before shifts every later one. Here every draw is keyed instead: the noise
that picks the token at position ``p`` (its index in prompt + output) comes from a generator seeded with a hash
of (the choice's seed, ``p``, what the draw is for), created on the spot. A resumed request (prompt + delivered
tokens as its prompt, the choice's seed ``seed + index`` as ``choice_resume`` passes it) therefore draws exactly
what the clean run drew at every later position, whichever worker, batch or step serves it.

What a draw is for (:class:`Stream`) keeps speculative decoding's draws apart from a plain token's: a draft
model's proposal for position ``p``, the uniform that accepts or rejects the draft at ``p``, and the token
finally sampled at ``p`` each have their own stream, so no two uses share noise.
"""

from __future__ import annotations

import enum
import hashlib

import torch


class Stream(enum.IntEnum):
    """What a keyed draw is used for (part of the key)."""

    TOKEN = 0  # the exponential noise that samples the token at a position
    DRAFT = 1  # a draft model's proposal for a position
    ACCEPT = 2  # the uniform that accepts or rejects the draft at a position


def draw_key(seed: int, position: int, stream: Stream) -> int:
    """A 63-bit generator seed for one draw: a hash, so neighbouring seeds and positions give unrelated noise."""
    if position < 0:
        raise ValueError(f"a draw's position must be >= 0, got {position}")
    digest = hashlib.blake2b(f"{seed}/{position}/{int(stream)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class SeededStream:
    """The draws of one seeded choice. ``seed`` is the choice's seed (the request's seed plus its index)."""

    def __init__(self, seed: int, device: torch.device | str) -> None:
        self.seed = seed
        self.device = torch.device(device)
        # One generator, re-seeded per draw: its state never carries from one draw to the next.
        self._generator = torch.Generator(device=self.device)

    def _at(self, position: int, stream: Stream) -> torch.Generator:
        self._generator.manual_seed(draw_key(self.seed, position, stream))
        return self._generator

    def exponential_(self, row: torch.Tensor, position: int, stream: Stream = Stream.TOKEN) -> torch.Tensor:
        """Fill ``row`` (on this stream's device) with Exp(1) noise for the draw at ``position``."""
        return row.exponential_(generator=self._at(position, stream))

    def uniform(self, positions: list[int], stream: Stream = Stream.ACCEPT) -> torch.Tensor:
        """One U[0, 1) draw per position, each keyed by its own position."""
        out = torch.empty(len(positions), device=self.device)
        for i, position in enumerate(positions):
            out[i : i + 1].uniform_(generator=self._at(position, stream))
        return out
