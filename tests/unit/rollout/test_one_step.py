"""Single-turn prompts on the episode runner (rollout/episode_runner.py): one-step episodes open on the prompt's
tokens, take one model turn of max_tokens (not cut by --max-episode-tokens), end, and come out as the group's G
answers; the chunked loop hands the engine a group's G samples as one prompt with a count, as a single-turn
rollout did (the HF engine batches them: one `generate` of G rows), and an engine that refuses a prompt
dead-letters it as `engine_rejected`."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from learner.tiny import tiny_tokenizer
from rollout.engines.base import Completion, RequestRefused, SamplingParams, counts
from rollout.episode_runner import ONE_STEP, EpisodeRunner, run_turn_by_turn, same_prompts
from rollout.metrics import RolloutMetrics
from rollout.settings import RolloutSettings
from services.schemas import PromptTask
from services.streams import Delivery


class RecordingEngine:
    """Answers each sample with `length` tokens and records what it was asked (the engine is not under test)."""

    version = 2

    def __init__(self, length: int = 3) -> None:
        self.tokenizer, self.length = tiny_tokenizer(), length
        self.calls: list[tuple[list[list[int]], list[int], int]] = []
        self.submitted: list[tuple[str, list[int], int, int]] = []

    def generate(self, prompts: list[list[int]], n: int | list[int], params: SamplingParams) -> list[list[Completion]]:
        k = counts(prompts, n)
        self.calls.append((prompts, k, params.max_tokens))
        return [[self._answer(p, j) for j in range(c)] for p, c in zip(prompts, k, strict=True)]

    def _answer(self, prompt: list[int], j: int) -> Completion:
        ids = [len(prompt) % 50 + j] * self.length
        return Completion(ids, f"answer {j}", [-0.5] * self.length, "stop")

    def submit(self, key: str, prompt: list[int], n: int, params: SamplingParams, *, priority: int = 0) -> None:
        if len(prompt) > 100:
            raise RequestRefused("longer than the context")
        self.submitted.append((key, prompt, n, params.max_tokens))


def runner(**kw: Any) -> EpisodeRunner:
    s = RolloutSettings(model_dir="/nonexistent", max_episode_tokens=4, **kw)  # type: ignore[arg-type]
    return EpisodeRunner(s, tiny_tokenizer(), RolloutMetrics(CollectorRegistry()))


def task(i: int, g: int = 3) -> Delivery[PromptTask]:
    t = PromptTask(task_id=f"t{i}", prompt_id=f"p{i}", prompt=f"q{i}", ground_truth="1", verifier="dapo_math",
                   data_source="test", n_samples=g)  # fmt: skip
    return Delivery(f"1-{i}", t, 1)


def test_one_step_episodes_are_a_groups_answers_in_one_engine_prompt() -> None:
    r, engine = runner(), RecordingEngine(length=6)
    params = SamplingParams(1.0, 1.0, 8, 7)
    for i, prompt in enumerate(([5, 6, 7], [8, 9])):
        r.start(task(i), params, prompt)
    assert r.pending() == 6 and r.live_env == 0 and not r.calls  # no environment call: ready at once
    assert run_turn_by_turn(engine, r) == 36  # the model tokens generated
    # one call: each prompt once with its G, the sampling's max_tokens (8), not --max-episode-tokens (4)
    assert engine.calls == [([[5, 6, 7], [8, 9]], [3, 3], 8)]
    done = r.take_finished()
    assert [d.message.task_id for d, _ in done] == ["t0", "t1"] and r.pending() == 0
    for (_, eps), prompt in zip(done, ([5, 6, 7], [8, 9]), strict=True):
        assert [e.env for e in eps] == [ONE_STEP] * 3 and all(e.opening == prompt for e in eps)
        assert [e.last.text for e in eps if e.last] == ["answer 0", "answer 1", "answer 2"]
        assert all(e.ended == "done" and e.model_turns == 1 and e.versions == [2] * 6 for e in eps)
        assert all(e.reward is None for e in eps)  # the reward server scores them when they are published


def test_continuous_batching_submits_each_answer_and_dead_letters_a_refused_prompt() -> None:
    r, engine = runner(), RecordingEngine()
    params = SamplingParams(1.0, 1.0, 8, None)
    r.start(task(0, g=2), params, [1, 2])
    r.start(task(1, g=2), params, list(range(200)))  # too long for the engine
    r.advance(engine, room=64)  # type: ignore[arg-type]
    assert [(p, n, m) for _, p, n, m in engine.submitted] == [([1, 2], 1, 8), ([1, 2], 1, 8)]
    for key, *_ in engine.submitted:
        r.engine_done(key, Completion([4], "x", [-1.0], "length"), 5)
    assert [(d.message.task_id, kind) for d, kind, _ in r.take_failed()] == [("t1", "engine_rejected")]
    (d, eps), = r.take_finished()  # fmt: skip
    assert d.message.task_id == "t0" and [e.last.finish_reason for e in eps if e.last] == ["length", "length"]
    assert all(e.versions == [5] for e in eps) and r.pending() == 0


def test_same_prompts_counts_runs_of_one_prompt() -> None:
    assert same_prompts([[1], [1], [2], [1]]) == ([[1], [2], [1]], [2, 1, 1])
    assert same_prompts([]) == ([], [])


def test_an_environment_named_like_the_local_one_is_still_an_environment() -> None:
    """Only a single-turn prompt is one-step: `env:one-step` is an environment task (reset on the service), and a
    single-turn prompt without its tokens is refused, not started."""
    r = runner(env_url="http://127.0.0.1:9", env_retries=0)
    t = task(0, g=2).message.model_copy(update={"verifier": f"env:{ONE_STEP}", "ground_truth": '{"seed": 1}'})
    r.start(Delivery("1-0", t, 1), SamplingParams())
    assert r.live_env == 2 and len(r.calls) == 2 and not r.ready  # two resets on their way to the service
    r.close()
    with pytest.raises(ValueError, match="open on its tokens"):
        r.start(task(1), SamplingParams())
