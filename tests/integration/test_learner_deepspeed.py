"""Real DeepSpeed on CPU on a tiny random Llama: the DAPO update moves log-probs the right way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.settings import LearnerSettings
from learner.tiny import group, tiny_llama
from learner.trainer import Trainer
from services.common.schemas import TrainBatch


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_positive_advantage_tokens_gain_probability(tmp_path: Path, stage: int) -> None:
    model_dir = tiny_llama(tmp_path / "model")
    s = LearnerSettings(model_dir=model_dir, run_dir=tmp_path / "run", zero_stage=stage, lr=1e-3, warmup_steps=0,
                        minibatches=2, micro_batch_size=2)  # fmt: skip
    trainer = Trainer(s)
    fixed = TrainBatch.assemble(0, [group(1, [1.0, -1.0, 1.0, -1.0]), group(2, [-1.0, 1.0, 0.0, 0.0])])
    before = trainer.sequence_logprob(fixed)
    metrics = [trainer.train(fixed) for _ in range(3)]
    after = trainer.sequence_logprob(fixed)
    rewards = torch.tensor([s.reward for g in fixed.groups for s in g.scores])
    up, down = rewards > 0, rewards < 0
    assert (after[up] > before[up]).all(), (before, after)
    assert (after[down] < before[down]).all(), (before, after)
    m = metrics[-1]
    for key in ("loss", "clip_frac_upper", "clip_frac_lower", "clip_frac_dual", "approx_kl", "entropy", "grad_norm",
                "lr", "tokens_per_s"):  # fmt: skip
        assert key in m and m[key] == m[key], key  # present and not NaN
    assert m["grad_norm"] > 0 and m["entropy"] > 0
