"""What the learner records of a trained batch (learner/episodes.py): each sample's own row of the batch's tensors —
its advantage, its tokens' pi_prox log-probs and loss mask — whatever the groups' prompt and response lengths."""

from __future__ import annotations

import statistics

import torch

from learner.advantages import group_advantages
from learner.batching import to_tensors
from learner.episodes import trained_records
from services.episode_log import expand
from services.schemas import PromptTask, Score, ScoredGroup, TrainBatch
from services.selfcheck import example_group

PROMPTS = {0: [7, 8, 9], 1: [7, 8, 9, 10, 11, 12]}  # groups 0 and 1: prompts of 3 and 6 tokens


def batch() -> TrainBatch:
    groups = []
    for i, n_tokens in ((0, 5), (1, 9)):
        g = example_group(i, n_samples=3, n_tokens=n_tokens)
        task = PromptTask.model_validate(g.task.model_dump() | {"prompt_token_ids": PROMPTS[i]})
        scores = [Score(reward=r, acc=r > 0) for r in ([1.0, -1.0, -1.0] if i == 0 else [1.0, 1.0, -1.0])]
        groups.append(ScoredGroup(task=task, samples=g.samples, scores=scores, replica_id=g.replica_id))
    return TrainBatch.assemble(3, groups)


def tensors(b: TrainBatch) -> object:
    t = to_tensors(b, pad_id=0)
    t.advantages = group_advantages(t.rewards, t.group_index)
    t.loss_mask = t.response_mask.clone()
    t.loss_mask[4, -1] = 0.0  # one token of one sample out of the loss (as the token-mask correction cuts)
    rows, cols = t.response_mask.shape
    marks = -(torch.arange(rows).view(-1, 1) * 100 + torch.arange(cols).view(1, -1)).float() / 1000
    t.old_logp = marks * t.loss_mask  # each position's value names its row and column
    return t


def test_each_sample_gets_its_own_row_advantage_and_tokens() -> None:
    b = batch()
    t = tensors(b)
    records = trained_records(b, t, version=4, wants=lambda gid: True)  # type: ignore[arg-type]
    assert [r["group_id"] for r in records] == [g.group_id for g in b.groups]
    row = 0
    for gi, (g, rec) in enumerate(zip(b.groups, records, strict=True)):
        rewards = [s.reward for s in g.scores]
        mean, std = statistics.fmean(rewards), statistics.stdev(rewards)  # torch.std: n - 1
        p = len(PROMPTS[gi])
        assert rec["version"] == 4 and rec["batch_id"] == 3 and rec["outcome"] == "trained"
        for j, (sample, got) in enumerate(zip(g.samples, rec["samples"], strict=True)):
            n = len(sample.response_token_ids)
            assert got["ids"] == sample.response_token_ids.tolist()
            assert abs(got["advantage"] - (rewards[j] - mean) / (std + 1e-6)) < 1e-3
            mask = expand(got["mask"], n, None)
            assert mask == [0 if (row == 4 and k == n - 1) else 1 for k in range(n)]
            want = [round(-(row * 100 + p + k) / 1000, 4) if mask[k] else 0.0 for k in range(n)]
            assert got["learner_logp"] == want
            row += 1


def test_only_the_wanted_groups_are_recorded_with_their_own_rows() -> None:
    b = batch()
    t = tensors(b)
    second = b.groups[1].group_id
    [rec] = trained_records(b, t, version=4, wants=lambda gid: gid == second)  # type: ignore[arg-type]
    assert rec["group_id"] == second
    assert rec["samples"][0]["learner_logp"][0] == round(-(3 * 100 + 6) / 1000, 4)  # row 3, after a 6-token prompt
