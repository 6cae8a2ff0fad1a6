"""The rule of a group sampled in rounds (PromptTask.budget), as pure functions: what the replica does after each
round (rollout/rounds.py), what it keeps, and the baseline of the advantages.

    d = decide(budget, n_samples, accs, rounds, draw)   # Decision("done" | "more" | "give_up", samples to add)
    keep = balanced(accs, n_samples)                     # indices of the balanced group (balanced rule)

The rules (docs: services/sampling-budgets.md):

    signal     rounds until the group holds a right and a wrong answer; then one round tops it up to n_samples
               (G) when it has fewer, and every sample is trained: a group of G or more (Reinforce-Ada-pos and
               AR3PO's adaptive rollout, with both outcomes as the signal DAPO's filter asks for).
    balanced   rounds until it holds G/2 right and G - G/2 wrong answers; then down-sampled to G (the first drawn
               of each outcome), the advantages' baseline the mean and std of every sample drawn
               (Reinforce-Ada-balance, `global_stat_est`).

Both: a first round whose answers all agree is given up with the task's `give_up` chance (the buffer's: its
prediction from the prompt's or its class's history that a group of G is uniform, or 1 - sampling_explore where
going on after such a round costs the prompt's task more than the run pays), else rounds go on; no rule ever draws
more than `most`. A group that reaches `most` still uniform is published as it is: the buffer drops it and counts
it, as any uniform group. A round's size is `round` (the first's `first`), cut so the total stays within `most`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Literal

from services.draws import derived_seed
from services.schemas import SamplingBudget


@dataclass(frozen=True)
class Decision:
    what: Literal["done", "more", "give_up"]
    add: int = 0  # samples of the next round ("more")


def decide(budget: SamplingBudget, n_samples: int, accs: list[bool], rounds: int, draw: float) -> Decision:
    """After `rounds` rounds whose samples' outcomes are `accs` (right/wrong): done, give up, or how many to add.
    `draw` is a uniform number in [0, 1) for the give-up (the task's: SamplingBudget.draw)."""
    n, right = len(accs), sum(accs)
    wrong = n - right
    if budget.rule == "signal":
        signal = right > 0 and wrong > 0
        if signal:
            return Decision("more", min(n_samples, budget.most) - n) if n < n_samples else Decision("done")
    else:
        want_right = n_samples // 2
        if right >= want_right and wrong >= n_samples - want_right:
            return Decision("done")
    if n >= budget.most:
        return Decision("done")
    if rounds == 1 and (right == 0 or wrong == 0) and draw < budget.give_up:
        return Decision("give_up")
    return Decision("more", min(budget.round, budget.most - n))


def balanced(accs: list[bool], n_samples: int) -> list[int]:
    """Indices (in drawing order) of the group the balanced rule trains: the first n/2 right and first n - n/2
    wrong answers, one side filled from the other where it is short; all of them when there are n or fewer."""
    if len(accs) <= n_samples:
        return list(range(len(accs)))
    right = [i for i, a in enumerate(accs) if a]
    wrong = [i for i, a in enumerate(accs) if not a]
    take_right = min(len(right), n_samples // 2)
    take_wrong = min(len(wrong), n_samples - take_right)
    take_right = min(len(right), n_samples - take_wrong)  # the wrong side short: more right ones
    return sorted(right[:take_right] + wrong[:take_wrong])


def pool_stats(rewards: list[float]) -> tuple[float, float]:
    """Mean and unbiased standard deviation of every reward drawn (one sample: std 1, as a group of one)."""
    if len(rewards) < 2:
        return (rewards[0] if rewards else 0.0), 1.0
    return statistics.fmean(rewards), statistics.stdev(rewards)


def round_seed(seed: int | None, rounds: int) -> int | None:
    """A seeded group's seed for round `rounds` (> 1): its own random stream (the first round's seed again would
    draw the same answers)."""
    if seed is None or rounds <= 1:
        return seed
    return derived_seed(seed, "round", str(rounds))
