"""Seeded uniform draws from a key: the same seed and key give the same number in any process (a decision made
again after a restart, or by another replica, comes out the same).

    u = uniform(seed, "prompt-7#e0p12", "give-up")     # in [0, 1)
"""

from __future__ import annotations

import hashlib


def uniform(seed: int | None, *key: str) -> float:
    """A number in [0, 1) fixed by the seed and the key (blake2b of them)."""
    digest = hashlib.blake2b(":".join([str(seed), *key]).encode(), digest_size=8).digest()
    return int.from_bytes(digest) / 2**64
