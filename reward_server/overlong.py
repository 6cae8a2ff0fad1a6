"""Overlong reward shaping, DAPO Eq. 13 (arXiv 2503.14476, §3.4 "Overlong Reward Shaping").

With L the response length in tokens, L_max the generation limit and L_cache the soft buffer:

    R_length(L) = 0                                  if L <= L_max - L_cache
                = ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
                = -1                                 if L > L_max

scaled by `factor`, and added to the rule reward (the correctness verdict `acc` never changes).
"""

from __future__ import annotations


def overlong_penalty(length: int, max_len: int, cache_len: int, factor: float = 1.0) -> float:
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    expected = max_len - cache_len
    if length <= expected:
        return 0.0
    if length <= max_len:
        return (expected - length) / cache_len * factor
    return -factor
