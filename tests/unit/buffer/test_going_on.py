"""The cost rule of the give-up (buffer/curriculum.py, sampling_give_up_by = "cost"): what going on after an
agreeing first round costs per trained sample, the run's ratio, the chance it gives, and which groups count."""

from __future__ import annotations

import random

import pytest

from buffer.curriculum import COST_MIN_GROUPS, GoingOn, RunCost, cost_give_up, going_on_args
from rollout.budget import decide
from services.schemas import GroupSampling, PromptTask, Sample, SamplingBudget, Score, ScoredGroup

BUDGET = SamplingBudget(rule="signal", first=2, round=2, most=8)


def group(accs: list[bool], sampling: GroupSampling | None, budget: SamplingBudget | None = BUDGET) -> ScoredGroup:
    task = PromptTask(task_id="p#e0p0", prompt_id="p", prompt="q", ground_truth="1", verifier="dapo_math",
                      data_source="reasoning_gym/t", n_samples=len(accs), budget=budget)  # fmt: skip
    samples = [Sample(response_token_ids=[1], response_text="x", logprobs=[-0.1], finish_reason="stop",
                      policy_version=0) for _ in accs]  # fmt: skip
    return ScoredGroup(task=task, samples=samples, scores=[Score(reward=float(a), acc=a) for a in accs],
                       replica_id="r", sampling=sampling)  # fmt: skip


def test_the_cost_of_going_on_is_extra_samples_per_trained_one_once_counted_enough() -> None:
    assert GoingOn(5, 30, 16, COST_MIN_GROUPS - 1).cost() is None  # too few groups to decide anything
    assert GoingOn(5, 30, 16, COST_MIN_GROUPS).cost() == pytest.approx(30 / 17)
    assert GoingOn(10, 60, 0, 10).cost() == 60  # never broke: its extra samples, not infinity
    assert RunCost(100, 0).ratio() is None and RunCost(100, 25).ratio() == 4


def test_a_task_is_given_up_only_where_going_on_costs_more_than_the_run_pays() -> None:
    cheap, costly, run = GoingOn(10, 40, 39, 10), GoingOn(10, 60, 7, 10), RunCost(400, 100)  # 1.0, 7.5 against 4
    assert cost_give_up(cheap, run, explore=0.1, floor=0.0) == 0.0
    assert cost_give_up(costly, run, explore=0.1, floor=0.0) == pytest.approx(0.9)
    assert cost_give_up(costly, run, explore=0.0, floor=0.0) == 1.0
    assert cost_give_up(cheap, run, explore=0.1, floor=0.3) == 0.3  # the floor holds either way
    assert cost_give_up(costly, run, explore=0.8, floor=0.3) == 0.3
    # unknown: the floor
    assert cost_give_up(None, run, explore=0.1, floor=0.2) == 0.2
    assert cost_give_up(GoingOn(3, 18, 0, 3), run, explore=0.1, floor=0.0) == 0.0  # under COST_MIN_GROUPS
    assert cost_give_up(costly, None, explore=0.1, floor=0.0) == 0.0
    assert cost_give_up(costly, RunCost(400, 0), explore=0.1, floor=0.0) == 0.0


def test_only_a_group_let_go_on_after_an_agreeing_first_round_counts_as_going_on() -> None:
    went_on = group([False, False, True, False, False, False, False, False],
                    GroupSampling(rounds=4, drawn=8, drawn_right=1, first_agreed=True))  # fmt: skip
    assert going_on_args(went_on, zero_variance=False)[:5] == ["reasoning_gym/t", 8, 8, 1, 6]
    assert going_on_args(went_on, zero_variance=False, stale=True)[:5] == ["reasoning_gym/t", 8, 0, 1, 6]  # drawn
    stayed = group([False] * 8, GroupSampling(rounds=4, drawn=8, drawn_right=0, first_agreed=True))
    assert going_on_args(stayed, zero_variance=True)[:5] == ["reasoning_gym/t", 8, 0, 1, 6]  # cost 6, nothing kept
    given_up = group([True, True], GroupSampling(rounds=1, drawn=2, drawn_right=2, gave_up=True, first_agreed=True))
    assert going_on_args(given_up, zero_variance=True)[:5] == ["reasoning_gym/t", 2, 0, 0, 0]  # the run's cost only
    topped_up = group([True, False] * 4, GroupSampling(rounds=2, drawn=8, drawn_right=4, first_agreed=False))
    assert going_on_args(topped_up, zero_variance=False)[:5] == ["reasoning_gym/t", 8, 8, 0, 6]
    older = group([True, False] * 4, GroupSampling(rounds=2, drawn=8, drawn_right=4))  # first_agreed unknown
    assert going_on_args(older, zero_variance=False)[3] == 0
    assert going_on_args(group([True, False], None, None), zero_variance=False)[0] == ""  # fixed: counts nowhere


@pytest.mark.parametrize(("p", "costly"), [(0.0, True), (0.02, True), (0.5, False), (0.85, False), (0.97, True)])
def test_the_rule_gives_up_the_tasks_whose_agreeing_pairs_rarely_break(p: float, costly: bool) -> None:
    """Groups of a task with pass rate p drawn by the real rule (2, then pairs up to 8; nothing given up): the
    counted cost of going on against a run paying 4 samples a trained one (the DAPO preset's 3.3-3.6, the
    out-of-reach configuration's 5) gives the task up where its agreeing pairs break too rarely to pay."""
    rng, going_on, run = random.Random(f"going-on-{p}"), GoingOn(0, 0, 0, 0), RunCost(400, 100)
    for _ in range(2000):
        accs, rounds = [rng.random() < p for _ in range(BUDGET.first)], 1
        while (verdict := decide(BUDGET, 8, accs, rounds, 1.0)).what == "more":  # draw 1: never given up
            accs += [rng.random() < p for _ in range(verdict.add)]
            rounds += 1
        if rounds > 1 and len(set(accs[:2])) == 1:
            kept = len(accs) if 0 < sum(accs) < len(accs) else 0
            going_on = GoingOn(going_on.groups + 1, going_on.extra + len(accs) - 2, going_on.kept + kept,
                               going_on.seen + 1)  # fmt: skip
    assert (cost_give_up(going_on, run, explore=0.1, floor=0.0) > 0) is costly, going_on.cost()
