"""The rule of groups sampled in rounds (rollout/budget.py): when a group is done, given up, or sampled more."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.budget import balanced, decide, pool_stats, round_seed
from services.draws import uniform
from services.schemas import SamplingBudget


def budget(rule: str = "signal", first: int = 4, rnd: int = 4, most: int = 16, give_up: float = 0.0) -> SamplingBudget:
    return SamplingBudget(rule=rule, first=first, round=rnd, most=most, give_up=give_up)


def test_a_round_that_finds_both_outcomes_ends_the_group_once_it_is_full() -> None:
    b = budget("signal")
    # both outcomes in the first 4 of G=8: one round tops it up to 8, then it is done
    assert decide(b, 8, [True, False, False, False], rounds=1, draw=0.9).__dict__ == {"what": "more", "add": 4}
    assert decide(b, 8, [True, False, False, False, True, False, True, True], rounds=2, draw=0.9).what == "done"
    # found in a later round, past G already: done at once (every sample is trained)
    assert decide(b, 8, [False] * 11 + [True], rounds=3, draw=0.9).what == "done"
    # G reached with a first round as large: done
    assert decide(budget("signal", first=8), 8, [True] + [False] * 7, rounds=1, draw=0.9).what == "done"


def test_the_balanced_rule_waits_for_half_of_each_then_keeps_a_balanced_group() -> None:
    b = budget("balanced")
    assert decide(b, 8, [True, False, False, False], rounds=1, draw=0.9) == decide(b, 8, [False] * 4, 1, 0.9)
    accs = [True, False, False, False, True, False, True, False, False, True]  # 4 right, 6 wrong: enough of each
    assert decide(b, 8, accs, rounds=3, draw=0.9).what == "done"
    keep = balanced(accs, 8)
    assert keep == [0, 1, 2, 3, 4, 5, 6, 9]  # the first 4 right (0, 4, 6, 9) and the first 4 wrong (1, 2, 3, 5)
    assert sum(accs[i] for i in keep) == 4
    # one side short at the budget's end: the other fills the group, first drawn first
    assert balanced([False] * 15 + [True], 8) == [0, 1, 2, 3, 4, 5, 6, 15]
    assert balanced([True, False], 8) == [0, 1]  # no more than it has


def test_a_prompt_that_agrees_in_its_first_round_is_given_up_with_the_stated_probability() -> None:
    b = budget("signal", give_up=0.3)
    draws = [uniform(7, f"prompt-{i}#e0p{i}", "give-up") for i in range(20_000)]
    given_up = sum(decide(b, 8, [False] * 4, rounds=1, draw=d).what == "give_up" for d in draws)
    assert given_up / len(draws) == pytest.approx(0.3, abs=0.01)  # binomial se 0.0032: 3 se
    right = sum(decide(b, 8, [True] * 4, rounds=1, draw=d).what == "give_up" for d in draws)
    assert right == given_up  # all right or all wrong alike
    # never a group with both outcomes, never after the first round, never with give_up 0
    assert all(decide(b, 8, [True, False, False, False], 1, d).what != "give_up" for d in draws[:500])
    assert all(decide(b, 8, [False] * 8, 2, d).what == "more" for d in draws[:500])
    assert all(decide(budget(give_up=0.0), 8, [False] * 4, 1, d).what == "more" for d in draws[:500])
    assert uniform(7, "a") == uniform(7, "a") != uniform(8, "a") != uniform(7, "b")  # seeded by seed and key


@settings(max_examples=400, deadline=None)
@given(
    rule=st.sampled_from(["signal", "balanced"]),
    g=st.integers(1, 16),
    first=st.integers(1, 16),
    rnd=st.integers(1, 16),
    extra=st.integers(0, 24),
    p=st.floats(0.0, 1.0),
    give_up=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32),
)
def test_the_maximum_budget_is_never_exceeded_and_every_group_ends(
    rule: str, g: int, first: int, rnd: int, extra: int, p: float, give_up: float, seed: int
) -> None:
    most = max(g, first) + extra
    b = budget(rule, first=first, rnd=rnd, most=most, give_up=give_up)
    rng = random.Random(seed)
    accs = [rng.random() < p for _ in range(first)]
    rounds = 1
    while (d := decide(b, g, accs, rounds, rng.random())).what == "more":
        assert d.add >= 1
        accs += [rng.random() < p for _ in range(d.add)]
        rounds += 1
        assert len(accs) <= most
        assert rounds <= most  # every round adds a sample: it ends
    if d.what == "give_up":
        assert rounds == 1 and len(set(accs)) == 1
    mixed = 0 < sum(accs) < len(accs)
    if rule == "signal" and mixed:
        assert len(accs) >= min(g, most)  # topped up to G
    if rule == "balanced" and len(accs) < most and d.what == "done":
        assert sum(accs) >= g // 2 and len(accs) - sum(accs) >= g - g // 2
    kept = balanced(accs, g) if rule == "balanced" else list(range(len(accs)))
    assert len(kept) == min(len(accs), g if rule == "balanced" else len(accs)) and len(set(kept)) == len(kept)


def test_the_pool_baseline_and_round_seeds() -> None:
    mean, std = pool_stats([1.0, -1.0, -1.0, -1.0])
    assert mean == -0.5 and std == pytest.approx((1.0 / 3 * (1.5**2 + 3 * 0.5**2)) ** 0.5)
    assert pool_stats([1.0]) == (1.0, 1.0)
    assert round_seed(5, 1) == 5 and round_seed(None, 3) is None
    assert len({round_seed(5, r) for r in (2, 3, 4)}) == 3 and 5 not in {round_seed(5, r) for r in (2, 3, 4)}


def test_a_budget_that_cannot_hold_the_group_is_refused() -> None:
    from pydantic import ValidationError

    from services.schemas import PromptTask

    with pytest.raises(ValidationError, match="first round of 9 passes the budget's most"):
        budget(first=9, most=8)
    with pytest.raises(ValidationError, match="most 6 is below n_samples 8"):
        PromptTask(task_id="t", prompt_id="p", prompt="x", ground_truth="1", verifier="dapo_math", data_source="d",
                   n_samples=8, budget=budget(first=2, most=6))  # fmt: skip


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.8])
def test_the_exact_expectations_of_the_docs_table(p: float) -> None:
    """bench/budget_weights.py (the docs' table of what each rule does to the gradient): every end of a group
    enumerated with its probability; checked against what is known in closed form."""
    from bench.budget_weights import expectation, outcomes

    signal = budget("signal", first=2, rnd=2, most=12, give_up=0.4)
    for b in (None, signal, budget("balanced", first=3, rnd=2, most=11, give_up=0.2)):
        assert sum(outcomes(p, 8, b).values()) == pytest.approx(1.0, abs=1e-12)
    # fixed G, the group's mean as baseline, no std: E = (G - 1) ∇E[r], whatever p
    assert expectation(p, 8, None, std=False).w == pytest.approx(7.0, abs=1e-9)
    # a rule that keeps all it draws, with no baseline: Wald's identity, E = E[N] ∇E[r] (N a stopping time)
    e = expectation(p, 8, signal, std=False, baseline="zero")
    assert e.w == pytest.approx(e.n, abs=1e-9) and 2.0 <= e.n <= 12.0
    # no give-up and no room past G: the signal rule draws exactly the fixed group
    same = expectation(p, 8, budget("signal", first=2, rnd=2, most=8, give_up=0.0))
    assert (same.w, same.n, same.kept) == pytest.approx(tuple(vars(expectation(p, 8, None)).values()))
    # every rule keeps a prompt's direction: its weight is positive
    assert expectation(p, 8, signal).w > 0 and expectation(p, 8, budget("balanced", most=16)).w > 0


def test_budgets_need_dynamic_sampling_and_room_for_the_group() -> None:
    from pydantic import ValidationError

    from buffer.settings import BufferSettings

    with pytest.raises(ValidationError, match="with dynamic_sampling off it would be trained"):
        BufferSettings(sampling_rule="signal", dynamic_sampling=False)
    with pytest.raises(ValidationError, match="continuous_rewards has none"):
        BufferSettings(sampling_rule="balanced", continuous_rewards=True)
    with pytest.raises(ValidationError, match="sampling_most 6 must be at least n_samples"):
        BufferSettings(sampling_rule="signal", n_samples=8, sampling_most=6)
    s = BufferSettings(sampling_rule="signal", n_samples=7)
    assert (s.budget_first, s.budget_most) == (3, 14)  # defaults: G // 2 and 2 G
    # dispatch keeps a group's worth of samples in flight per slot: 7 // 3 first rounds; fixed: one prompt
    assert s.prompts_per_slot == 2 and BufferSettings(n_samples=8).prompts_per_slot == 1
    assert BufferSettings(sampling_rule="signal", n_samples=8, sampling_first=2).prompts_per_slot == 4
