"""The curriculum's maths (buffer/curriculum.py): the Beta-binomial prediction, the dispatch chance, the bands."""

from __future__ import annotations

import json
import math
import random

import pytest

from buffer.curriculum import (
    ClassState,
    PromptState,
    band,
    decide,
    difficulty_class,
    dispatch_probability,
    zero_variance_probability,
)


def state(correct: float, samples: float, groups: int = 1, streak: int = 0) -> PromptState:
    return PromptState(correct, samples, groups, 0, streak)


def test_prediction_is_the_beta_binomial_probability_that_g_samples_agree() -> None:
    assert zero_variance_probability(None, 8) is None  # no history: nothing to predict
    assert zero_variance_probability(state(0, 0, groups=0), 8) is None
    # the closed form, checked by Monte Carlo: p ~ Beta(a, b), then 8 draws all equal
    a, b = 0.25 + 7, 0.25 + 1
    rng = random.Random(0)
    hits = 0
    for _ in range(40_000):
        p = rng.betavariate(a, b)
        k = sum(rng.random() < p for _ in range(8))
        hits += k in (0, 8)
    q = zero_variance_probability(state(7, 8), 8)
    assert q is not None and abs(q - hits / 40_000) < 0.01
    one_right = zero_variance_probability(state(8, 8), 8)
    assert one_right is not None and 0.8 < one_right < 0.9  # one all-right group: 0.85 with the default prior
    two_right = zero_variance_probability(state(8 * 1.5, 8 * 1.5, groups=2), 8)  # a second one, decay 0.5
    assert two_right is not None and two_right > one_right  # more evidence: surer
    half = zero_variance_probability(state(4, 8), 8)
    assert half is not None and half < 0.05  # a 4-of-8 prompt is informative
    assert zero_variance_probability(state(8, 8), 1) == pytest.approx(1.0)  # one sample always agrees with itself


def test_dispatch_chance_decays_with_the_streak_down_to_the_exploration_floor() -> None:
    def p(q: float | None, streak: int, explore: float = 0.02) -> float:
        return dispatch_probability(q, streak, explore=explore, streak_decay=0.5)

    assert p(None, 0) == 1.0  # no history: always
    assert p(0.3, 0) == pytest.approx(0.7)  # the chance the group is kept
    assert p(0.84, 1) == pytest.approx(0.08) and p(0.84, 2) == pytest.approx(0.04)  # each filtered group halves it
    assert p(0.9, 5) == 0.02 and p(1.0, 0, explore=0.0) == 0.0  # the floor


def test_decisions_are_seeded_per_slot_and_match_their_probability() -> None:
    assert [decide(0.5, 3, 1, i) for i in range(50)] == [decide(0.5, 3, 1, i) for i in range(50)]
    assert [decide(0.5, 3, 1, i) for i in range(50)] != [decide(0.5, 3, 2, i) for i in range(50)]
    hits = sum(decide(0.15, 7, 0, i) for i in range(20_000)) / 20_000
    assert abs(hits - 0.15) < 3 * math.sqrt(0.15 * 0.85 / 20_000)


def test_bands() -> None:
    assert band(None) == "unseen"
    assert [band(state(c, 8)) for c in (0, 1, 4, 7, 8)] == ["unsolved", "hard", "medium", "easy", "solved"]


def test_the_curriculum_needs_the_accuracy_filter_it_predicts() -> None:
    from buffer.settings import BufferSettings

    with pytest.raises(ValueError, match="needs dynamic_sampling on"):
        BufferSettings(dispatch_policy="curriculum", dynamic_sampling=False)
    with pytest.raises(ValueError, match="continuous_rewards off"):
        BufferSettings(dispatch_policy="curriculum", continuous_rewards=True)
    assert BufferSettings(dispatch_policy="curriculum").dispatch_policy == "curriculum"


def test_a_prompts_class_is_its_task_and_the_difficulty_its_metadata_names() -> None:
    import reasoning_gym

    item = reasoning_gym.create_dataset("chain_sum", size=4, seed=1, min_digits=2, max_digits=2)[0]
    truth = json.dumps({"answer": item["answer"], "metadata": item["metadata"]})
    src = "reasoning_gym/chain_sum"
    assert difficulty_class(src, truth, "difficulty") == f"{src}|num_digits=2,num_terms={item['metadata']['num_terms']}"
    assert difficulty_class(src, truth, "task") == src
    assert difficulty_class(src, truth, "none") is None
    gsm = json.dumps({"answer": "7", "metadata": {"difficulty": 1.0, "variables": {}}})  # a scalar difficulty
    assert difficulty_class("rg/gsm_symbolic", gsm, "difficulty") == "rg/gsm_symbolic|difficulty=1.0"
    # a file row's ground truth is an answer, not metadata: its task (data source) alone
    assert difficulty_class("math", "42", "difficulty") == difficulty_class("math", "[1, 2]", "difficulty") == "math"
    assert difficulty_class("t", json.dumps({"metadata": {"difficulty": {"n": [1, 3]}}}), "difficulty") == "t"


def test_a_class_predicts_its_first_groups_drop_share_once_it_has_a_few() -> None:
    assert ClassState(3, 3, 3).predict() is None  # fewer than CLASS_MIN_GROUPS first groups: nothing predicted
    assert ClassState(4, 4, 4).predict() == pytest.approx(4.5 / 5)
    assert ClassState(0, 10, 40).predict() == pytest.approx(0.5 / 11)
    assert ClassState(3.5, 3.5, 4).predict() == pytest.approx(4 / 4.5)  # decayed below 4: counted by first groups
    assert ClassState.parse("[2.5, 5.0, 9]") == ClassState(2.5, 5.0, 9)
