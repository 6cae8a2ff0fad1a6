"""The LR schedule in trained batches, against the formulas written here."""

from __future__ import annotations

import math

import pytest

from learner.schedule import lr_factor


def test_warm_up_counts_batches_then_constant() -> None:
    assert [lr_factor(k, warmup=4) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(0, warmup=0) == 1.0 and lr_factor(100, warmup=0) == 1.0


def test_cosine_after_the_warm_up() -> None:
    got = [lr_factor(k, warmup=2, schedule="cosine", decay=4, min_ratio=0.1) for k in range(9)]
    want = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, j / 4))) for j in range(7)]
    assert got == pytest.approx(want)
    assert got[2] == pytest.approx(1.0) and got[6] == pytest.approx(0.1) and got[8] == pytest.approx(0.1)


def test_a_cosine_needs_a_length() -> None:
    with pytest.raises(ValueError, match="decay over"):
        lr_factor(5, warmup=0, schedule="cosine")
    from learner.settings import LearnerSettings

    with pytest.raises(ValueError, match="lr_decay_batches"):
        LearnerSettings(lr_schedule="cosine")
    assert LearnerSettings(lr_schedule="cosine", max_batches=10).lr_schedule == "cosine"
