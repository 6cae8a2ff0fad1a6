"""The verdict every verifier returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    score: float
    acc: bool
    pred: str | None = None
    error: str | None = None
    timed_out: bool = False
