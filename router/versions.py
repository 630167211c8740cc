"""Which version of a routed model serves one request: the fast path for a short prompt, else a weighted,
sticky choice among the route's versions. Pure: counting tokens and the live weights come from the caller.

Stickiness is weighted rendezvous hashing (highest random weight): each version scores the sticky key with a
hash of its own, scaled by its weight, and the best score wins. The same key always lands on the same version
while the weights stand, the share of keys per version follows the weights, and when one version's weight
changes (a canary rolled back to 0) only the keys that version held move; everyone else stays put.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from .routes import RouteSpec

Reason = Literal["split", "fast_path"]


@dataclass(frozen=True)
class VersionChoice:
    """The version a request goes to and why."""

    route: str
    version: str
    reason: Reason


def _unit(route: str, version: str, key: str) -> float:
    """A uniform number in (0, 1) from the hash of route, version and key."""
    digest = hashlib.blake2b(f"{route}\x00{version}\x00{key}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 1) / (2**64 + 2)


def rendezvous(route: str, key: str, weights: Mapping[str, float]) -> str:
    """The version ``key`` sticks to under ``weights`` (versions at weight 0 never win; ``ValueError`` when
    every weight is 0)."""
    best, best_score = None, -math.inf
    for version, weight in weights.items():
        if weight <= 0:
            continue
        score = -weight / math.log(_unit(route, version, key))
        if score > best_score:
            best, best_score = version, score
    if best is None:
        raise ValueError(f"route {route!r} has no version with a weight above 0")
    return best


def choose_version(
    route: str,
    spec: RouteSpec,
    *,
    sticky_key: str,
    weights: Mapping[str, float],
    prompt_tokens: Callable[[int], int | None],
) -> VersionChoice:
    """The fast path when the prompt is shorter than its bound, else the weighted sticky choice.

    ``prompt_tokens(limit)`` counts the prompt with the fast model's tokenizer, or says None when it cannot
    tell (or knows it is at least ``limit`` without counting it all).
    """
    fast = spec.fast_path
    if fast is not None:
        count = prompt_tokens(fast.max_prompt_tokens)
        if count is not None and count < fast.max_prompt_tokens:
            return VersionChoice(route, fast.model, "fast_path")
    return VersionChoice(route, rendezvous(route, sticky_key, weights), "split")
