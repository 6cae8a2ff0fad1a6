"""Groups sampled in rounds on a real replica (rollout/rounds.py): vLLM's continuous batching on the tiny model, real
Redis, a real reward server, and an environment server whose episodes come out right with chance 0.35 whatever the
answer (tests/integration/third_party_env.py's `coin`), so groups meet both outcomes at random. Each group is
checked against the rule it was sent with: how many samples it drew, in how many rounds, what it kept, and that its
prompt was acknowledged with it and nothing was run twice."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.redis_server import EmbeddedRedis, free_port
from services.schemas import GroupSampling, PromptTask, SamplingBudget, ScoredGroup
from services.streams import DEAD_LETTER_STREAM, STREAM_PROMPTS, StreamProducer, connect
from tests.integration import third_party_env
from tests.integration.test_rollout_worker import start, stop, tasks, wait_groups

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
G = 4
SIGNAL = SamplingBudget(rule="signal", first=2, round=2, most=8, give_up=0.5)
BALANCED = SamplingBudget(rule="balanced", first=2, round=3, most=11, give_up=0.0)
ONE_STEP = SamplingBudget(rule="signal", first=2, round=2, most=6, give_up=0.0)


def coin_task(i: int, budget: SamplingBudget) -> PromptTask:
    return PromptTask(task_id=f"c{i}", prompt_id=f"c{i}", prompt="coin", ground_truth=json.dumps({"seed": i}),
                      verifier="env:coin", data_source="coin", n_samples=G, budget=budget)  # fmt: skip


def test_groups_sampled_in_rounds_follow_their_rule(model_dir: Path, reward_url: str, server: EmbeddedRedis) -> None:
    client = connect(server.url)
    sent = [coin_task(i, SIGNAL) for i in range(10)] + [coin_task(i, BALANCED) for i in range(10, 20)]
    single = [t.model_copy(update={"task_id": f"s{i}", "budget": ONE_STEP}) for i, t in enumerate(tasks(3, g=G))]
    with third_party_env.serve(bug="coin", name="coin") as env_url:
        StreamProducer(client, STREAM_PROMPTS).publish_many(sent + single)
        port = free_port()
        proc = start(model_dir, server.url, reward_url, "r0", "--env-routes", json.dumps({"coin": env_url}),
                     "--seed", "3", "--port", str(port), engine="vllm")  # fmt: skip
        try:
            got = {g.task.task_id: g for g in wait_groups(client, len(sent) + len(single), timeout_s=400)}
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        finally:
            stop(proc)
        stats = httpx.get(f"{env_url}/debug/stats", timeout=10).json()
    assert client.xlen(DEAD_LETTER_STREAM) == 0
    assert client.xpending(STREAM_PROMPTS, "rollout")["pending"] == 0  # every prompt acknowledged with its group
    coin = [got[f"c{i}"] for i in range(20)]
    # every episode drawn ran once on the environment server, none twice, none for nothing
    assert stats["resets"] == sum(g.drawn for g in coin) == stats["steps"]
    outcomes = {"gave_up": 0, "signal": 0, "most": 0, "balanced": 0}
    for g in coin[:10]:
        s = check(g, SIGNAL)
        accs = [x.acc for x in g.scores]
        assert s.first_agreed is (len(set(accs[: SIGNAL.first])) == 1)  # every sample kept, in drawing order
        if s.gave_up:
            outcomes["gave_up"] += 1
            assert s.rounds == 1 and s.drawn == len(g.samples) == 2 and len(set(accs)) == 1
        elif len(set(accs)) == 2:
            outcomes["signal"] += 1
            assert len(g.samples) == s.drawn >= G  # topped up to G, every sample kept
        else:
            outcomes["most"] += 1
            assert s.drawn == SIGNAL.most == len(g.samples)  # still uniform at the budget's end: published as is
    for g in coin[10:]:
        s = check(g, BALANCED)
        accs = [x.acc for x in g.scores]
        assert s.pool_mean is not None and s.pool_std is not None and s.drawn >= len(g.samples)
        if s.drawn < BALANCED.most:
            outcomes["balanced"] += 1
            assert len(g.samples) == G and sum(accs) == G // 2  # half right, half wrong
        assert s.drawn == BALANCED.first + BALANCED.round * (s.rounds - 1) or s.drawn == BALANCED.most
    assert outcomes["signal"] >= 2 and outcomes["balanced"] >= 3, outcomes  # with p = 0.35, all but certain
    for i in range(3):  # single-turn prompts: every round scored by the reward server, uniform to the budget's end
        g = got[f"s{i}"]
        s = check(g, ONE_STEP)
        assert s.drawn == len(g.samples) == 6 and s.rounds == 3 and not s.gave_up and s.first_agreed
        assert len({x.acc for x in g.scores}) == 1 and g.task.prompt_token_ids is not None
        assert len({tuple(x.response_token_ids.tolist()) for x in g.samples}) > 1  # seeded apart per round
    families = {f.name: f for f in text_string_to_metric_families(text)}
    drawn = {s.name: s.value for s in families["dapo_rollout_group_samples_drawn"].samples}
    assert drawn["dapo_rollout_group_samples_drawn_count"] == len(got)
    assert drawn["dapo_rollout_group_samples_drawn_sum"] == sum(g.drawn for g in got.values())
    given_up = families["dapo_rollout_groups_given_up"].samples[0].value
    assert given_up == outcomes["gave_up"]


def check(g: ScoredGroup, budget: SamplingBudget) -> GroupSampling:
    """What every group sampled in rounds keeps: its record of them, within its budget, its rounds' sizes."""
    s = g.sampling
    assert s is not None and 1 <= s.rounds and s.drawn <= budget.most and s.first_agreed is not None
    assert len(g.samples) == len(g.scores) == g.task.n_samples <= s.drawn
    assert s.drawn >= budget.first + (s.rounds - 1)  # each later round added a sample at least
    assert g.task.budget == budget  # the task as it was sent
    right = sum(x.acc for x in g.scores)
    assert s.drawn_right >= right and s.drawn - s.drawn_right >= len(g.scores) - right  # it kept of what it drew
    if s.drawn == len(g.samples):
        assert s.drawn_right == right
    return s
