"""The curriculum against a real Redis (buffer/curriculum.py): the per-prompt state is updated atomically and once
per group, and the buffer skips what its state predicts dynamic sampling would drop, with the stated probability,
and brings skipped prompts back."""

from __future__ import annotations

import collections
import json
import math
import threading
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry

from buffer.curriculum import KEY_PROMPT_STATE, ClassState, PromptStates
from buffer.metrics import BufferMetrics
from buffer.service import Buffer
from services.datasets import load_source
from services.redis_server import EmbeddedRedis
from services.schemas import PromptTask, Sample, Score, ScoredGroup, TrainBatch
from services.streams import STREAM_BATCHES, STREAM_PROMPTS, StreamConsumer, connect, decode
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


def run_out(buffer: Buffer, rollout: Rollout, steps: int) -> None:
    """Step the buffer and serve its prompts until its dataset is exhausted (at most `steps` rounds)."""
    for _ in range(steps):
        buffer.step(block_ms=5)
        rollout.serve()
        if buffer.status.startswith("dataset exhausted"):
            return


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
    before, again, counted, _ = states[1].record(groups[-1], zero_variance=False, version=200)
    assert before == again == got and not counted  # a redelivery changes nothing and says so
    for c in clients:
        c.close()


def test_a_prompt_state_decays_and_counts_its_streak(client: redis.Redis) -> None:
    states = PromptStates(client, decay=0.5)
    first, s, counted, _ = states.record(group("q", 0, [True, False, False, False]), zero_variance=False, version=3)
    assert first is None and counted and (s.correct, s.samples, s.groups) == (1, 4, 1)
    before, s, _, _ = states.record(group("q", 1, [True] * 4), zero_variance=True, version=2)
    assert before is not None and before.groups == 1
    assert (s.correct, s.samples, s.groups, s.version, s.streak) == (4.5, 6.0, 2, 3, 1)
    s = states.record(group("q", 2, [True] * 4), zero_variance=True, version=4).after
    assert (s.correct, s.samples, s.streak) == (6.25, 7.0, 2)
    assert states.record(group("q", 3, [True, False] * 2), zero_variance=False, version=5)[1].streak == 0
    assert states.get(["q", "unknown"])[1] is None
    assert dict(states.scan()).keys() == {"q"}


def test_the_buffer_skips_solved_prompts_with_the_stated_probability(client: redis.Redis) -> None:
    """Half the prompts always all right (solved), half mixed: after the first pass the solved ones are dispatched
    at the chance their state gives, the mixed ones always; and every solved prompt comes back at some point."""
    s = settings(
        dispatch_policy="curriculum",
        max_epochs=40,
        batch_size=8,
        max_staleness=3,
        curriculum_explore=0.02,
        curriculum_streak_decay=0.5,
        n_samples=8,
        curriculum_shared="none",  # every first group goes out (the default; the class prior is tested below)
    )
    buffer = Buffer(s, client, SMALL, BufferMetrics(CollectorRegistry()))
    solved = {buffer.source.train[i].prompt_id for i in range(0, 40, 2)}
    rollout = Rollout(client, lambda t, i: [True] * 8 if t.prompt_id in solved else [True, False] * 4)
    run_out(buffer, rollout, 1000)
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
    with_history = buffer.m.predicted_groups.labels("prompt")._value.get()
    predicted = buffer.m.predicted.labels("prompt")._value.get() / with_history
    observed = buffer.m.observed.labels("prompt")._value.get() / with_history
    assert abs(predicted - observed) < 0.25 and not math.isnan(predicted)


def test_uniform_dispatches_every_prompt_every_epoch(client: redis.Redis) -> None:
    buffer = Buffer(settings(max_epochs=3, batch_size=8, max_staleness=3), client, SMALL,
                    BufferMetrics(CollectorRegistry()))  # fmt: skip
    rollout = Rollout(client, lambda t, i: [True] * 4)
    run_out(buffer, rollout, 100)
    counts = collections.Counter(decode(f, PromptTask).prompt_id for _, f in client.xrange(STREAM_PROMPTS))
    assert len(counts) == 40 and set(counts.values()) == {3}
    assert len(client.hgetall(KEY_PROMPT_STATE)) == 40  # the state is kept under either policy (observability)


def test_a_prompts_first_group_counts_once_in_its_class_under_two_writers(server: EmbeddedRedis) -> None:
    """Each prompt's first group (and only that one) counts in its class, in the script that counts it in the
    prompt: two writers recording the same groups at once count each first group once."""
    clients = [connect(server.url), connect(server.url)]
    states = [PromptStates(c, decay=1.0, class_decay=1.0) for c in clients]  # plain sums, checkable
    firsts = [group(f"p{i}", 0, [True] * 4 if i % 3 == 0 else [True, False] * 2) for i in range(60)]
    seconds = [group(f"p{i}", 1, [False] * 4) for i in range(60)]
    both = threading.Barrier(2)

    def write(k: int) -> None:
        for first, second in zip(firsts, seconds, strict=True):
            both.wait(10)
            states[k].record(first, zero_variance=first.scores[0].acc == first.scores[1].acc, version=0, klass="c")
            states[k].record(second, zero_variance=True, version=1, klass="c")

    threads = [threading.Thread(target=write, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    (c,) = states[0].classes(["c"])
    assert c is not None and (c.groups, c.dropped) == (60, 20)  # 60 first groups, 20 of them all right
    assert states[0].classes(["unknown"]) == [None]
    # the class's state before a first group comes back with it; not with a later group, nor a redelivery
    r = states[0].record(group("new", 0, [True, False]), zero_variance=False, version=2, klass="c")
    assert r.before is None and r.class_before == c and r.class_before.predict() == pytest.approx(20.5 / 61)
    assert (
        states[0].record(group("new", 1, [True, False]), zero_variance=False, version=2, klass="c").class_before is None
    )
    assert states[1].record(group("new", 0, [True, False]), zero_variance=False, version=2, klass="c").counted is False
    assert states[0].classes(["c"])[0] == ClassState(20, 61, 61)
    for cl in clients:
        cl.close()


def test_unseen_prompts_of_a_class_whose_first_groups_are_dropped_are_skipped(client: redis.Redis) -> None:
    """chain_sum with 1- and 2-digit terms: every 2-digit prompt answers all wrong, every 1-digit one mixed. In the
    first pass, once a class has a few first groups, its unseen prompts go out with the chance its first groups
    were kept: the 2-digit ones at about the floor, the 1-digit ones almost all; with `curriculum_shared = none`
    every prompt goes out."""
    source = load_source("reasoning_gym:chain_sum", size=300, seed=3, eval_size=0, config=CFG)
    two_digit = {it.prompt_id for it in source.train if json.loads(it.ground_truth)["metadata"]["num_digits"] == 2}
    assert 100 < len(two_digit) < 200

    def first_pass(shared: str) -> tuple[float, float, Buffer]:
        client.flushdb()
        s = settings(dispatch_policy="curriculum", curriculum_shared=shared, max_epochs=1, batch_size=16,
                     max_staleness=0, curriculum_explore=0.05, n_samples=4)  # fmt: skip
        buffer = Buffer(s, client, source, BufferMetrics(CollectorRegistry()))
        rollout = Rollout(client, lambda t, i: [False] * 4 if t.prompt_id in two_digit else [True, False] * 2)
        run_out(buffer, rollout, 2000)
        sent = {decode(f, PromptTask).prompt_id for _, f in client.xrange(STREAM_PROMPTS)}
        one = len(sent - two_digit) / (300 - len(two_digit))
        return len(sent & two_digit) / len(two_digit), one, buffer

    hard, easy, buffer = first_pass("difficulty")
    assert buffer.status.startswith("dataset exhausted")
    assert hard < 0.2 and easy > 0.85, (hard, easy)  # 2-digit: the floor 0.05 after the first 4+ (up to 16 sent
    # before any came back); 1-digit: q = 0.5 / (n + 1), dispatched with 1 - q
    classes = dict(zip(*[["reasoning_gym/chain_sum|num_digits=1,num_terms=2",
                          "reasoning_gym/chain_sum|num_digits=2,num_terms=2"]] * 2, strict=True))  # fmt: skip
    got = buffer.states.classes(list(classes))
    assert got[0] is not None and got[0].dropped < 0.01 and got[1] is not None and got[1].dropped > 0.9 * got[1].groups
    assert buffer.m.predicted_groups.labels("class")._value.get() > 0
    assert buffer.m.observed.labels("class")._value.get() > 0  # the 2-digit explorations, dropped as predicted
    # a prompt with history follows its own state, not its class's: a 2-digit prompt with a mixed group goes out
    unseen = [it for it in source.train if it.prompt_id in two_digit and not buffer.states.get([it.prompt_id])[0]]
    mixed = unseen.pop()
    own = buffer.states.record(group(mixed.prompt_id, 0, [True, False] * 2), zero_variance=False, version=0).after
    share = [sum(buffer.choose([(it, 9, p) for p in range(400)])) / 400 for it in (mixed, unseen[0])]
    assert abs(share[0] - (1 - (buffer.predict(own) or 0))) < 0.08, share  # its own chance, 1 - q = 0.73 (G = 4)
    assert share[1] < 0.15, share  # an unseen one of its class: about the floor
    hard, easy, _ = first_pass("none")
    assert hard == easy == 1.0


def test_a_group_sampled_in_rounds_counts_every_sample_it_drew(client: redis.Redis) -> None:
    """A balanced group trains 2 right and 2 wrong of the 12 it drew (1 right): its prompt's history counts the 12,
    not the half-right 4 (the give-up chance and the bands read this history)."""
    from services.schemas import GroupSampling

    states = PromptStates(client, decay=1.0)
    g = group("drawn", 0, [True, True, False, False])
    g = g.model_copy(update={"sampling": GroupSampling(rounds=4, drawn=12, drawn_right=2, pool_mean=-2 / 3,
                                                       pool_std=0.78)})  # fmt: skip
    s = states.record(g, zero_variance=False, version=0).after
    assert (s.correct, s.samples, s.groups) == (2, 12, 1)
    plain = states.record(group("plain", 0, [True, True, False, False]), zero_variance=False, version=0).after
    assert (plain.correct, plain.samples) == (2, 4)


def test_the_buffer_sends_each_task_its_budget_with_a_give_up_chance_from_history(client: redis.Redis) -> None:
    """sampling_rule signal: every dispatched task carries its budget; a prompt with no history is given up with
    `sampling_give_up`, one whose history predicts a uniform group with that prediction where it is larger; the
    buffer counts the samples the groups drew (generated) and those it put in batches (trained)."""
    s = settings(sampling_rule="signal", sampling_first=2, sampling_round=2, sampling_most=8, sampling_give_up=0.3,
                 n_samples=8, batch_size=4, max_staleness=1)  # fmt: skip
    buffer = Buffer(s, client, SMALL, BufferMetrics(CollectorRegistry()))
    solved = {buffer.source.train[i].prompt_id for i in range(0, 40, 2)}
    rollout = Rollout(client, lambda t, i: [True] * 8 if t.prompt_id in solved else [True, False] * 4)
    run_out(buffer, rollout, 30)
    tasks = [decode(f, PromptTask) for _, f in client.xrange(STREAM_PROMPTS)]
    assert tasks and all(t.budget is not None for t in tasks)
    first = [t for t in tasks if "#e0p" in t.task_id]
    assert all(t.budget and (t.budget.rule, t.budget.first, t.budget.round, t.budget.most) == ("signal", 2, 2, 8)
               for t in tasks)  # fmt: skip
    assert all(t.budget and t.budget.give_up == 0.3 for t in first)  # no history yet
    draws = [t.budget.draw for t in tasks if t.budget]  # the buffer's seeded draw: every replica decides the same
    assert all(d is not None and 0 <= d < 1 for d in draws) and len(set(draws)) == len(draws)
    later = [t for t in tasks if "#e0p" not in t.task_id and t.prompt_id in solved]
    assert later, "the run reached a second pass"
    for t in later:
        q = buffer.predict(buffer.states.get([t.prompt_id])[0])
        assert q is not None and q > 0.3 and t.budget and t.budget.give_up >= 0.3
    generated = buffer.m.samples_generated._value.get()
    trained = buffer.m.samples_trained._value.get()
    assert generated == 8 * len(rollout.groups) and trained == 8 * 4 * buffer.m.batches._value.get() > 0


def test_a_budget_keeps_a_groups_worth_of_samples_in_flight_per_slot(client: redis.Redis) -> None:
    """Dispatch keeps (max_staleness + 1) x B groups' worth of samples outstanding: with groups of G = 8 in one round
    that is 8 prompts; sampled in rounds whose first is 2, four prompts' first rounds make a group's worth, so 32 go
    out — counted as whole groups, the replica would batch 16 sequences instead of 64 and the learner would wait."""
    fixed = Buffer(
        settings(n_samples=8, batch_size=4, max_staleness=1), client, SMALL, BufferMetrics(CollectorRegistry())
    )
    assert fixed.dispatch() == 8 and fixed.dispatch() == 0  # nothing came back: the budget is spent
    client.flushdb()
    s = settings(sampling_rule="signal", sampling_first=2, sampling_most=8, n_samples=8, batch_size=4, max_staleness=1)
    rounds = Buffer(s, client, SMALL, BufferMetrics(CollectorRegistry()))
    assert rounds.dispatch() == 32 and rounds.dispatch() == 0


def test_a_stalled_learner_stops_a_budgets_dispatch_within_the_staleness_bound(client: redis.Redis) -> None:
    """Groups received count as whole groups against the budget (four first rounds each here): with the learner
    stalled, the buffer publishes the (max_staleness + 1) batches the bound allows and stops — not four times
    that, as when a waiting group counted as one prompt."""
    s = settings(sampling_rule="signal", sampling_first=2, sampling_most=8, n_samples=8, batch_size=4, max_staleness=1)
    buffer = Buffer(s, client, SMALL, BufferMetrics(CollectorRegistry()))
    StreamConsumer(client, STREAM_BATCHES, "learner", "stalled", TrainBatch)  # the learner's group, never reading
    # one prompt in four gives a group that is kept (a budget's case: most prompts cost a first round and go)
    rollout = Rollout(client, lambda t, i: [True, False] * 4 if i % 4 == 0 else [False] * 8, learns=False)
    for _ in range(60):
        buffer.step(block_ms=5)
        rollout.serve()
    kept = sum(len({x.acc for x in g.scores}) == 2 for g in rollout.groups)
    assert client.xlen(STREAM_BATCHES) == 2 and kept == 8 + len(buffer.carry), (client.xlen(STREAM_BATCHES), kept)
    assert buffer.dispatch() == 0
