"""The cost rule of the give-up against a real Redis (sampling_give_up_by = "cost"): the buffer counts what going on
after an agreeing first round cost, once per group, and gives up the agreeing first rounds of the task where it costs
more than the run pays — the prompts out of the model's reach — and not those of a learnable one."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry

from buffer.curriculum import COST_DECAY, GoingOn, PromptStates
from buffer.metrics import BufferMetrics
from buffer.service import Buffer
from rollout.budget import decide
from services.datasets import load_source
from services.redis_server import EmbeddedRedis
from services.schemas import GroupSampling, PromptTask, Sample, SamplingBudget, Score, ScoredGroup
from services.streams import connect
from tests.integration.test_buffer import CFG, Rollout, settings

MIXTURE = load_source("reasoning_gym:chain_sum=1; reasoning_gym:basic_arithmetic=1", size=200, seed=3, eval_size=0,
                      config=CFG)  # fmt: skip
PASS = {"reasoning_gym/chain_sum": 0.0, "reasoning_gym/basic_arithmetic": 0.5}  # out of reach; learnable


@pytest.fixture
def client(server: EmbeddedRedis) -> Iterator[redis.Redis]:
    c = connect(server.url)
    yield c
    c.close()


class RoundsRollout(Rollout):
    """Answers prompts as a replica sampling in rounds would, by the real rule (rollout/budget.py decide) with each
    task's budget and draw; each sample is right with its task's pass rate. Plays the learner too."""

    def __init__(self, client: redis.Redis, seed: int = 0):
        super().__init__(client, lambda t, i: [])  # its own serve draws the outcomes
        self.rng = random.Random(seed)

    def serve(self, limit: int = 64) -> int:
        self.learn()
        n = 0
        for d in self.consumer.read(count=limit, block_ms=50):
            t, b = d.message, d.message.budget
            assert b is not None and b.draw is not None
            p = PASS[t.data_source]
            accs, rounds = [self.rng.random() < p for _ in range(b.first)], 1
            while (verdict := decide(b, t.n_samples, accs, rounds, b.draw)).what == "more":
                accs += [self.rng.random() < p for _ in range(verdict.add)]
                rounds += 1
            agreed = len(set(accs[: b.first])) == 1
            sampling = GroupSampling(rounds=rounds, drawn=len(accs), drawn_right=sum(accs),
                                     gave_up=verdict.what == "give_up", first_agreed=agreed)  # fmt: skip
            samples = [Sample(response_token_ids=[5], response_text="x", logprobs=[-0.1], finish_reason="stop",
                              policy_version=0) for _ in accs]  # fmt: skip
            g = ScoredGroup(task=t.model_copy(update={"n_samples": len(accs)}), samples=samples,
                            scores=[Score(reward=1.0 if a else -1.0, acc=a) for a in accs], replica_id="fake",
                            sampling=sampling)  # fmt: skip
            self.out.publish(g)
            self.consumer.ack(d.entry_id)
            self.groups.append(g)
            n += 1
        return n


def test_the_out_of_reach_tasks_agreeing_first_rounds_are_given_up_and_the_learnable_ones_go_on(
    client: redis.Redis,
) -> None:
    s = settings(sampling_rule="signal", sampling_first=2, sampling_round=2, sampling_most=8, sampling_give_up=0.0,
                 sampling_give_up_by="cost", sampling_explore=0.1, n_samples=8, batch_size=4,
                 max_staleness=1)  # fmt: skip
    buffer = Buffer(s, client, MIXTURE, BufferMetrics(CollectorRegistry()))
    rollout = RoundsRollout(client)
    for _ in range(400):
        buffer.step(block_ms=5)
        rollout.serve()
        if sum(g.task.data_source.endswith("chain_sum") for g in rollout.groups) >= 150:
            break
    out, learnable = "reasoning_gym/chain_sum", "reasoning_gym/basic_arithmetic"
    chances = {name: [g.task.budget.give_up for g in rollout.groups if g.task.data_source == name and g.task.budget]
               for name in (out, learnable)}  # fmt: skip
    # until 8 groups went on after an agreeing pair the floor (0) holds, then the out-of-reach task is given up
    assert chances[out][:8] == [0.0] * 8
    assert chances[out][-40:] == [pytest.approx(0.9)] * 40, chances[out]
    assert set(chances[learnable]) == {0.0}  # its agreeing pairs break (1 - 2/64 of them): never given up
    late = [g for g in rollout.groups if g.task.data_source == out and g.task.budget and g.task.budget.give_up > 0]
    assert len(late) >= 100
    given_up = sum(bool(g.sampling and g.sampling.gave_up) for g in late) / len(late)
    assert given_up == pytest.approx(0.9, abs=0.1)  # every agreeing pair (all are) with 0.9: binomial se 0.03
    cost = buffer.m.going_on_cost.labels(out)._value.get()
    assert cost > buffer.m.drawn_per_kept._value.get() > buffer.m.going_on_cost.labels(learnable)._value.get() > 0


def test_a_group_counts_once_in_its_tasks_cost_of_going_on(client: redis.Redis) -> None:
    """A redelivered group (the buffer restarted, or two read it) changes no cost: counted in the same script as
    its prompt's state, under its tag."""
    states = PromptStates(client, decay=1.0)
    budget = SamplingBudget(rule="signal", first=2, round=2, most=8)
    task = PromptTask(task_id="p#e0p0", prompt_id="p", prompt="q", ground_truth="1", verifier="dapo_math",
                      data_source="t", n_samples=6, budget=budget)  # fmt: skip
    accs = [False, False, False, True, False, False]
    g = ScoredGroup(task=task, samples=[Sample(response_token_ids=[1], response_text="x", logprobs=[-0.1],
                                               finish_reason="stop", policy_version=0) for _ in accs],
                    scores=[Score(reward=float(a), acc=a) for a in accs], replica_id="r",
                    sampling=GroupSampling(rounds=3, drawn=6, drawn_right=1, first_agreed=True))  # fmt: skip
    assert states.record(g, zero_variance=False, version=0).counted
    assert not states.record(g, zero_variance=False, version=0).counted
    (going_on,), run = states.going_on(["t"])
    assert going_on == GoingOn(1, 4, 6, 1) and run is not None and (run.drawn, run.kept) == (6, 6)
    assert states.going_on(["other"])[0] == [None]
    late = g.model_copy(update={"task": task.model_copy(update={"task_id": "p#e1p0"})})  # outlived the bound
    assert states.record(late, zero_variance=False, version=0, stale=True).counted  # drawn, not kept
    (going_on,), run = states.going_on(["t"])
    d = COST_DECAY  # the older group weighs d
    assert going_on == GoingOn(pytest.approx(1 + d), pytest.approx(4 * d + 4), pytest.approx(6 * d), 2)
    assert run is not None and (run.drawn, run.kept) == (pytest.approx(6 * d + 6), pytest.approx(6 * d))
