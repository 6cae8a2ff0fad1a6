"""The curriculum against a real Redis (buffer/curriculum.py): the per-prompt state is updated atomically and once
per group, and the buffer skips what its state predicts dynamic sampling would drop, with the stated probability,
and brings skipped prompts back."""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry

from buffer.curriculum import KEY_PROMPT_STATE, PromptStates
from buffer.metrics import BufferMetrics
from buffer.service import Buffer
from services.datasets import load_source
from services.redis_server import EmbeddedRedis
from services.schemas import PromptTask, Sample, Score, ScoredGroup
from services.streams import STREAM_PROMPTS, connect, decode
from tests.integration.test_buffer import CFG, Rollout, settings

SMALL = load_source("reasoning_gym:chain_sum", size=40, seed=3, eval_size=0, config=CFG)


@pytest.fixture
def client(server: EmbeddedRedis) -> Iterator[redis.Redis]:
    c = connect(server.url)
    yield c
    c.close()


def group(prompt: str, n: int, accs: list[bool]) -> ScoredGroup:
    task = PromptTask(task_id=f"{prompt}#g{n}", prompt_id=prompt, prompt="q", ground_truth="1", verifier="dapo_math",
                      data_source="t", n_samples=len(accs))  # fmt: skip
    samples = [Sample(response_token_ids=[1], response_text="x", logprobs=[-0.1], finish_reason="stop",
                      policy_version=n) for _ in accs]  # fmt: skip
    return ScoredGroup(task=task, samples=samples, scores=[Score(reward=float(a), acc=a) for a in accs],
                       replica_id="r")  # fmt: skip


def test_two_writers_update_a_prompt_atomically_and_count_a_group_once(server: EmbeddedRedis) -> None:
    groups = [group("p", i, [True] * (i % 5) + [False] * (4 - i % 5)) for i in range(120)]
    clients = [connect(server.url), connect(server.url)]
    states = [PromptStates(c, decay=1.0) for c in clients]  # decay 1: plain sums, checkable
    both = threading.Barrier(2)

    def write(k: int) -> None:
        for i, g in enumerate(groups):
            if i % 3 == 0:  # every third group is read by both writers at once: counted once
                both.wait(10)
                states[k].record(g, zero_variance=False, version=i)
            elif i % 3 == k + 1:  # the others by one writer each, interleaved with the other's
                states[k].record(g, zero_variance=False, version=i)

    threads = [threading.Thread(target=write, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    got = states[0].get(["p"])[0]
    assert got is not None
    assert got.groups == 120 and got.samples == 480 and got.correct == sum(i % 5 for i in range(120))
    assert got.version == 119
    before, again, counted = states[1].record(groups[-1], zero_variance=False, version=200)
    assert before == again == got and not counted  # a redelivery changes nothing and says so
    for c in clients:
        c.close()


def test_a_prompt_state_decays_and_counts_its_streak(client: redis.Redis) -> None:
    states = PromptStates(client, decay=0.5)
    first, s, counted = states.record(group("q", 0, [True, False, False, False]), zero_variance=False, version=3)
    assert first is None and counted and (s.correct, s.samples, s.groups) == (1, 4, 1)
    before, s, _ = states.record(group("q", 1, [True] * 4), zero_variance=True, version=2)
    assert before is not None and before.groups == 1
    assert (s.correct, s.samples, s.groups, s.version, s.streak) == (4.5, 6.0, 2, 3, 1)
    _, s, _ = states.record(group("q", 2, [True] * 4), zero_variance=True, version=4)
    assert (s.correct, s.samples, s.streak) == (6.25, 7.0, 2)
    assert states.record(group("q", 3, [True, False] * 2), zero_variance=False, version=5)[1].streak == 0
    assert states.get(["q", "unknown"])[1] is None
    assert dict(states.scan()).keys() == {"q"}


def test_the_buffer_skips_solved_prompts_with_the_stated_probability(client: redis.Redis) -> None:
    """Half the prompts always all right (solved), half mixed: after the first pass the solved ones are dispatched
    at the chance their state gives, the mixed ones always; and every solved prompt comes back at some point."""
    s = settings(dispatch_policy="curriculum", max_epochs=40, batch_size=8, max_staleness=3, curriculum_explore=0.02,
                 curriculum_streak_decay=0.5, n_samples=8)  # fmt: skip
    buffer = Buffer(s, client, SMALL, BufferMetrics(CollectorRegistry()))
    solved = {buffer.source.train[i].prompt_id for i in range(0, 40, 2)}
    rollout = Rollout(client, lambda t, i: [True] * 8 if t.prompt_id in solved else [True, False] * 4)
    for _ in range(1000):
        buffer.step(block_ms=5)
        rollout.serve()
        if buffer.status.startswith("dataset exhausted"):
            break
    tasks = [decode(f, PromptTask) for _, f in client.xrange(STREAM_PROMPTS)]
    later = collections.Counter(t.prompt_id for t in tasks if not t.task_id.split("#e")[1].startswith("0p"))
    epochs = buffer.cursor.epoch  # epochs 1.. of the run
    assert epochs == 39
    mixed_ids = {it.prompt_id for it in list(buffer.source.train)} - solved
    mixed_chance = sum(later[p] for p in mixed_ids) / (len(mixed_ids) * epochs)
    assert mixed_chance > 0.9  # 4 of 8 right: P(8 agree) is ~0.03 (Beta-binomial, the prior and two groups' evidence)
    # solved prompts: one all-right group of 8 predicts q = 0.84, so the next turn's chance is (1 - 0.84) x 0.5 (the
    # streak of 1); each further all-right group halves it again, down to the floor 0.02
    q = buffer.predict(buffer.states.get([next(iter(solved))])[0])
    assert q is not None and q > 0.83
    chance = sum(later[p] for p in solved) / (len(solved) * epochs)
    assert 0.02 * 0.5 < chance < 0.06, chance  # far below 1, about the floor (the first turns of epoch 1 go out
    # before epoch 0's groups are back: no history yet)
    skipped = buffer.m.skipped.labels("reasoning_gym/chain_sum")._value.get()
    assert skipped == 40 * epochs - sum(later.values())  # every slot not dispatched: counted
    assert sum(1 for p in solved if later[p] > 0) >= len(solved) * 0.25  # skipped prompts come back (p ~ 0.55 each)
    buffer.update_bands()
    assert {b: buffer.m.bands.labels(b)._value.get() for b in ("solved", "medium", "unseen")} == {
        "solved": 20, "medium": 20, "unseen": 0}  # fmt: skip
    predicted = buffer.m.predicted._value.get() / buffer.m.predicted_groups._value.get()
    observed = buffer.m.observed._value.get() / buffer.m.predicted_groups._value.get()
    assert abs(predicted - observed) < 0.25 and not math.isnan(predicted)


def test_uniform_dispatches_every_prompt_every_epoch(client: redis.Redis) -> None:
    buffer = Buffer(settings(max_epochs=3, batch_size=8, max_staleness=3), client, SMALL,
                    BufferMetrics(CollectorRegistry()))  # fmt: skip
    rollout = Rollout(client, lambda t, i: [True] * 4)
    for _ in range(100):
        buffer.step(block_ms=5)
        rollout.serve()
        if buffer.status.startswith("dataset exhausted"):
            break
    counts = collections.Counter(decode(f, PromptTask).prompt_id for _, f in client.xrange(STREAM_PROMPTS))
    assert len(counts) == 40 and set(counts.values()) == {3}
    assert len(client.hgetall(KEY_PROMPT_STATE)) == 40  # the state is kept under either policy (observability)
