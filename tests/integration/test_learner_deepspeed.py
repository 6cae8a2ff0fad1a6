"""Real DeepSpeed on CPU on a tiny random Llama: the DAPO update moves log-probs the right way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.batching import BatchTensors, microbatches, to_tensors
from learner.loss import token_logprobs_and_entropy
from learner.settings import LearnerSettings
from learner.tiny import group
from learner.trainer import Trainer
from services.arrays import LogProbs
from services.dtype import resolve_dtype
from services.schemas import TrainBatch


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "dtype"), [(0, "fp32"), (0, "bf16"), (2, "bf16")])
def test_positive_advantage_tokens_gain_probability(tiny_model: Path, tmp_path: Path, stage: int, dtype: str) -> None:
    model_dir = tiny_model
    s = LearnerSettings(model_dir=model_dir, run_dir=tmp_path / "run", zero_stage=stage, lr=1e-3, warmup_batches=0,
                        minibatches=2, micro_batch_size=2, dtype=dtype)  # fmt: skip
    trainer = Trainer(s)
    assert trainer.dtype == resolve_dtype(s.dtype)  # bf16 where this machine has it, and then in bf16 weights
    assert next(trainer.engine.module.parameters()).dtype == (
        torch.bfloat16 if trainer.dtype == "bf16" else torch.float32
    )
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


def with_behaviour(batch: TrainBatch, logp: float) -> TrainBatch:
    """The same batch, as if sampled by a policy that gave every token log-prob `logp`."""
    groups = [g.model_copy(update={"samples": [s.model_copy(update={"logprobs": LogProbs([logp] * len(s.logprobs))})
                                               for s in g.samples]}) for g in batch.groups]  # fmt: skip
    return TrainBatch.assemble(batch.batch_id, groups)


@pytest.mark.slow
def test_the_off_policy_correction_weighs_the_update(tiny_model: Path, tmp_path: Path) -> None:
    """Samples whose behaviour policy is far from the learner's (log-prob -0.1 per token where the tiny model
    gives about -5.5): uncorrected they move the weights; with token-mask every token leaves the band [1/C, C]
    and nothing moves; token-tis scales the update by the tiny weights. The gap is measured either way."""
    model_dir = tiny_model
    batch = with_behaviour(TrainBatch.assemble(0, [group(1, [1.0, -1.0, 1.0, -1.0]), group(2, [-1.0, 1.0, 1.0, 0.0])]),
                           -0.1)  # fmt: skip
    grad, moved = {}, {}
    for mode in ("off", "token-mask", "token-tis"):
        s = LearnerSettings(model_dir=model_dir, run_dir=tmp_path / mode, lr=1e-2, warmup_batches=0, minibatches=1,
                            micro_batch_size=4, weight_decay=0.0, off_policy=mode,
                            off_policy_cap=2.0)  # type: ignore[arg-type]  # fmt: skip
        trainer = Trainer(s)
        before = [p.detach().clone() for p in trainer.engine.module.parameters()]
        m = trainer.train(batch, version=3)
        after = list(trainer.engine.module.parameters())
        moved[mode] = sum(float((a - b).abs().sum()) for a, b in zip(after, before, strict=True))
        grad[mode] = m["grad_norm"]
        assert m["logp_gap_mean"] == pytest.approx(5.4, abs=0.3) and m["behav_kl"] > 1  # far off-policy
        assert "logp_gap_mean_lag3" in m  # the samples are version 0, the learner at 3
        if mode != "off":
            assert m["is_bound_frac"] == (1.0 if mode == "token-mask" else 0.0)
    assert moved["off"] > 0 and moved["token-mask"] == 0.0 and grad["token-mask"] == 0.0  # nothing left to learn
    assert 0 < grad["token-tis"] < grad["off"] / 50  # weights of about e^-5.4 (Adam's step hides the scale)


@pytest.mark.slow
def test_the_lr_follows_batches_not_optimizer_steps(tiny_model: Path, tmp_path: Path) -> None:
    """Two mini-batches per batch used to advance a warm-up of 2 *optimizer* steps within the first batch. The
    warm-up counts batches now, and a learner resuming at version 5 is where the schedule says."""
    model_dir = tiny_model
    s = LearnerSettings(model_dir=model_dir, run_dir=tmp_path / "run", lr=1e-3, warmup_batches=2, minibatches=2,
                        micro_batch_size=4, lr_schedule="cosine", lr_decay_batches=4, lr_min_ratio=0.0)  # fmt: skip
    trainer = Trainer(s)
    batch = TrainBatch.assemble(0, [group(1, [1.0, -1.0, 1.0, -1.0])])
    lrs = [trainer.train(batch)["lr"] for _ in range(3)]
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3])
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)  # what the optimizer steps with
    assert trainer.train(batch, version=4)["lr"] == pytest.approx(1e-3 * 0.5)  # 2 batches into a 4-batch cosine
    assert trainer.train(batch, version=9)["lr"] == pytest.approx(0.0, abs=1e-12)


def sampled_at(trainer: Trainer, batch: TrainBatch, temps: list[float], claim: list[float] | None = None) -> TrainBatch:
    """The batch as a rollout at temperature temps[g] would send it: behaviour log-probs of the learner's current
    weights at that temperature; each Sample says it was sampled at claim[g] (default: the truth)."""
    from learner.loss import token_logprobs

    groups = []
    for g, temp, said in zip(batch.groups, temps, claim or temps, strict=True):
        prompt = g.task.prompt_token_ids.tolist()
        samples = []
        for s in g.samples:
            ids = torch.tensor([prompt + s.response_token_ids.tolist()])
            with torch.no_grad():
                lp = token_logprobs(trainer.engine.module(ids).logits.float() / temp, ids)[0, len(prompt) :]
            samples.append(s.model_copy(update={"logprobs": LogProbs(lp.tolist()), "temperature": said}))
        groups.append(g.model_copy(update={"samples": samples}))
    return TrainBatch.assemble(batch.batch_id, groups)


@pytest.mark.slow
def test_the_learner_scores_at_each_sample_s_temperature(tiny_model: Path, tmp_path: Path) -> None:
    """Behaviour log-probs come at the sampling temperature. The learner used to score at T = 1: a batch sampled at
    0.7 looked off-policy by the difference. Now the proximal log-probs equal the behaviour ones at the first
    update (no gap), for one temperature and for a batch that mixes two; a sample that misstates its temperature
    shows the gap."""
    s = LearnerSettings(model_dir=tiny_model, run_dir=tmp_path / "run", lr=1e-3, warmup_batches=0,
                        minibatches=1, micro_batch_size=4, dtype="fp32")  # fmt: skip
    trainer = Trainer(s)
    base = TrainBatch.assemble(0, [group(1, [1.0, -1.0, 1.0, -1.0]), group(2, [-1.0, 1.0, 1.0, -1.0])])
    for temps in ([0.7, 0.7], [0.7, 1.0]):
        m = trainer.train(sampled_at(trainer, base, temps))
        assert m["logp_gap_mean"] < 1e-5 and m["behav_kl"] < 1e-8, (temps, m)
        assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    wrong = trainer.train(sampled_at(trainer, base, [0.7, 0.7], claim=[1.0, 1.0]))
    assert wrong["logp_gap_mean"] > 0.05  # what every T != 1 batch looked like before


class OldPathTrainer(Trainer):
    """The learner as it was before the speed work: log-probs from the model's full [B, T, V] logits, micro-batches
    of a fixed count of rows in shuffled order, padded to the longest."""

    def micro(self, idx: torch.Tensor, t: BatchTensors) -> list[torch.Tensor]:
        return list(microbatches(idx, self.s.micro_batch_size))

    def _logprobs(
        self, part: BatchTensors, only: torch.Tensor, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = part.input_ids.to(self.device)
        logits = self.engine(input_ids=ids, attention_mask=part.attention_mask.to(self.device)).logits
        return token_logprobs_and_entropy(logits / part.temperature.view(-1, 1, 1), ids, with_entropy=with_entropy)


@pytest.mark.slow
def test_fp32_token_budget_and_chunks_reproduce_the_old_update(tiny_model: Path, tmp_path: Path) -> None:
    """--dtype fp32 with token-budget micro-batches and chunked log-probs gives the loss, the metrics and the
    weights of the old path (full logits, 3 rows per micro-batch) within float rounding, over two batches of
    samples of different lengths at two temperatures."""
    model_dir = tiny_model
    common = dict(model_dir=model_dir, lr=1e-3, warmup_batches=0, minibatches=2, dtype="fp32", off_policy="token-tis")
    new = Trainer(LearnerSettings(run_dir=tmp_path / "a", micro_batch_tokens=40, logprob_chunk=7, **common))  # type: ignore[arg-type]
    old = OldPathTrainer(LearnerSettings(run_dir=tmp_path / "b", micro_batch_tokens=0, micro_batch_size=3, **common))  # type: ignore[arg-type]
    groups = [group(i, [1.0, -1.0, 0.5, -0.5, 1.0, -1.0], prompt_len=4 + 3 * i, resp_len=6 + 5 * i) for i in range(3)]
    temps = [1.0, 0.7, 1.0]
    groups = [g.model_copy(update={"samples": [x.model_copy(update={"temperature": tp}) for x in g.samples]})
              for g, tp in zip(groups, temps, strict=True)]  # fmt: skip
    batch = TrainBatch.assemble(0, groups)
    assert len(new.micro(torch.arange(18), to_tensors(batch, new.pad_id))) > 3  # the budget really splits it
    grads_new, grads_old = capture_grads(new), capture_grads(old)
    for _ in range(2):
        m_new, m_old = new.train(batch), old.train(batch)
        for key in ("loss", "clip_frac_upper", "clip_frac_lower", "approx_kl", "entropy", "grad_norm", "logp_gap_mean"):
            assert m_new[key] == pytest.approx(m_old[key], rel=1e-4, abs=1e-6), key
    assert len(grads_new) == len(grads_old) == 4  # 2 batches x 2 mini-batches
    for step_new, step_old in zip(grads_new, grads_old, strict=True):
        for a, b in zip(step_new, step_old, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    start = Trainer(LearnerSettings(run_dir=tmp_path / "c", **common))  # type: ignore[arg-type]
    moved = 0.0
    for a, b, w0 in zip(new.engine.module.parameters(), old.engine.module.parameters(),
                        start.engine.module.parameters(), strict=True):  # fmt: skip
        # AdamW divides by sqrt(v): a coordinate whose gradient is ~0 turns rounding into up to ~1% of a step
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        moved += float((a - w0).abs().sum())
    assert moved > 1e-2  # the weights did move: equal because the updates are, not because nothing happened


def capture_grads(trainer: Trainer) -> list[list[torch.Tensor]]:
    """The gradients each optimizer step is about to apply (fp32, ZeRO 0: in p.grad)."""
    seen: list[list[torch.Tensor]] = []
    step = trainer.engine.step

    def spy(*a: object, **kw: object) -> object:
        seen.append([p.grad.detach().clone() for p in trainer.engine.module.parameters() if p.grad is not None])
        return step(*a, **kw)

    trainer.engine.step = spy  # type: ignore[method-assign]
    return seen
