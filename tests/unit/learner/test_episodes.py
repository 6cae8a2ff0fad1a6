"""The learner on episodes: an episode's environment turns are context, never loss. The rows the learner
builds carry a response mask of 1 on the model's tokens only (their behaviour log-probs with them), and what the
environment's tokens hold — their log-probs under any policy — changes neither the loss nor its gradient."""

from __future__ import annotations

import torch

from learner.batching import to_tensors
from learner.loss import policy_loss
from services.schemas import Sample, ScoredGroup, TrainBatch, Turn
from services.selfcheck import example_group

PROMPT = lambda text: [7, 8, 9, 10]  # noqa: E731
TURNS = [Turn(role="model", tokens=3), Turn(role="env", tokens=2), Turn(role="model", tokens=4)]


def episode_batch() -> TrainBatch:
    g = example_group(0, n_samples=2, n_tokens=9)
    episode = Sample.model_validate(g.samples[0].model_dump() | {"turns": [t.model_dump() for t in TURNS]})
    return TrainBatch.assemble(0, [ScoredGroup.model_validate(g.model_dump() | {"samples": [episode, g.samples[1]]})])


def test_rows_mask_the_environment_turns_out() -> None:
    batch = episode_batch()
    t = to_tensors(batch, pad_id=0, tokenize=PROMPT)
    p = 4
    assert t.response_mask[0, p : p + 9].tolist() == [1, 1, 1, 0, 0, 1, 1, 1, 1]
    assert t.response_mask[1, p : p + 9].tolist() == [1] * 9  # a one-turn sample: every response token
    assert t.behaviour_logp[0, p + 3 : p + 5].tolist() == [0.0, 0.0]
    sample = batch.groups[0].samples[0]
    assert t.input_ids[0, p : p + 9].tolist() == sample.response_token_ids.tolist()  # context: the ids stay
    assert t.response_tokens == 9 + 7


def test_environment_tokens_change_neither_the_loss_nor_its_gradient() -> None:
    t = to_tensors(episode_batch(), pad_id=0, tokenize=PROMPT)
    g = torch.Generator().manual_seed(0)
    old = torch.randn(t.response_mask.shape, generator=g) * 0.1 - 2
    adv = torch.tensor([1.0, -1.0])
    env = (t.attention_mask > 0) & (t.response_mask == 0)  # prompt and environment tokens
    moved = old + torch.randn(old.shape, generator=g) * 0.05  # the policy moved a little on every token
    losses, grads = [], []
    for noise in (0.0, 5.0):  # and, the second time, a lot on the environment's tokens
        logp = (moved + env * noise).requires_grad_()
        loss, _ = policy_loss(logp, old, adv, t.response_mask)
        loss.backward()
        assert logp.grad is not None
        losses.append(loss.detach())
        grads.append(logp.grad.clone())
    assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])
    assert float(grads[0][env].abs().max()) == 0.0
    assert float(grads[0][t.response_mask > 0].abs().max()) > 0
