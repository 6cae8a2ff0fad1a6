"""Seeded numbers from a key: the same seed and key give the same number in any process (a decision made again
after a restart, or by another replica, comes out the same; a seeded call's own random stream).

    u = uniform(seed, "prompt-7#e0p12", "give-up")     # in [0, 1)
    s = derived_seed(seed, "round", "2")               # a 63-bit seed of its own
"""

from __future__ import annotations

import hashlib


def _digest(seed: int | None, key: tuple[str, ...]) -> int:
    """64 bits of blake2b over "seed:key:..."."""
    return int.from_bytes(hashlib.blake2b(":".join([str(seed), *key]).encode(), digest_size=8).digest())


def uniform(seed: int | None, *key: str) -> float:
    """A number in [0, 1) fixed by the seed and the key."""
    return _digest(seed, key) / 2**64


def derived_seed(seed: int, *key: str) -> int:
    """A seed of its own for what the key names, fixed by the seed (non-negative, below 2**63)."""
    return _digest(seed, key) >> 1
