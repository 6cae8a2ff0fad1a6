"""The learning-rate schedule, counted in trained batches (rollout steps, policy versions), as the DAPO paper counts
its 20 warm-up steps — not in optimizer steps, of which a batch makes `minibatches` (16 in the paper).

    lr = base_lr * lr_factor(batches_done, warmup=20, schedule="constant")

Linear warm-up over the first `warmup` batches (batch k, counted from 0, gets (k + 1) / warmup), then constant,
or a cosine from 1 down to `min_ratio` over the next `decay` batches (and `min_ratio` after them). A function of
the number of batches trained alone: a learner restarted from a checkpoint (whose version is that number) is
back on the schedule with no scheduler state to restore.
"""

from __future__ import annotations

import math
from typing import Literal

Schedule = Literal["constant", "cosine"]


def lr_factor(
    batches_done: int, *, warmup: int, schedule: Schedule = "constant", decay: int | None = None, min_ratio: float = 0.0
) -> float:
    if batches_done < warmup:
        return (batches_done + 1) / warmup
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"unknown schedule {schedule!r}: constant or cosine")
    if not decay or decay < 1:
        raise ValueError("a cosine schedule needs the number of batches to decay over (>= 1)")
    progress = min(1.0, (batches_done - warmup) / decay)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
