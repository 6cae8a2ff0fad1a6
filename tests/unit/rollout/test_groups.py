"""One builder of groups from episodes, for the replica's own episodes and the gateway's sessions: one task, one
prompt (the openings' common start), each episode re-based on it, each sample with its own sampling."""

from __future__ import annotations

import pytest

from rollout.engines.base import Completion
from rollout.episodes import Episode
from rollout.groups import GroupRefused, env_scores, episode_group
from services.schemas import PromptTask

TASK = PromptTask(task_id="t", prompt_id="p", prompt="q", ground_truth='{"seed": 1}', verifier="env:x",
                  data_source="d", n_samples=2)  # fmt: skip


def episode(
    opening: list[int], answer: list[int], reward: float, key: str | None = "task-1", t: float = 1.0
) -> Episode:
    ep = Episode("x", opening, temperature=t, task_key=key)
    ep.add_model(Completion(answer, "", [-0.5] * len(answer), "stop"), version=3)
    ep.reward, ep.ended = reward, "done"
    return ep


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def test_openings_that_differ_after_a_shared_start_are_rebased_on_it() -> None:
    eps = [episode([1, 2, 3, 4], [9], 1.0, t=0.7), episode([1, 2, 5], [8, 7], -1.0)]
    g = episode_group(TASK, eps, env_scores(eps), "r", decode)
    assert g.task.prompt_token_ids.tolist() == [1, 2] and g.task.n_samples == 2
    first, second = g.samples
    assert first.response_token_ids.tolist() == [3, 4, 9] and first.loss_mask() == [0, 0, 1]
    assert second.response_token_ids.tolist() == [5, 8, 7] and second.loss_mask() == [0, 1, 1]
    assert first.logprobs.tolist()[:2] == [0.0, 0.0] and first.token_versions() == [3, 3, 3]
    assert (first.temperature, second.temperature) == (0.7, 1.0)  # each sample's own sampling
    assert [s.reward for s in g.scores] == [1.0, -1.0] and [s.acc for s in g.scores] == [True, False]
    assert first.response_text == "3 4 9"


def test_episodes_of_different_tasks_or_no_shared_token_are_no_group() -> None:
    with pytest.raises(GroupRefused, match="different tasks"):
        eps = [episode([1, 2], [9], 1.0, key="a"), episode([1, 2], [9], 1.0, key="b")]
        episode_group(TASK, eps, env_scores(eps), "r", decode)
    with pytest.raises(GroupRefused, match="share no token"):
        eps = [episode([1, 2], [9], 1.0), episode([3, 2], [9], 1.0)]
        episode_group(TASK, eps, env_scores(eps), "r", decode)
    eps = [episode([1, 2], [9], 1.0, key=None), episode([1, 2], [9], 1.0, key="a")]  # the gateway's: no env key
    assert episode_group(TASK, eps, env_scores(eps), "r", decode).task.prompt_token_ids.tolist() == [1, 2]
