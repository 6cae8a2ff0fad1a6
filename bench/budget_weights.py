"""What a sampling rule does to the gradient's expectation, computed exactly (docs: services/sampling-budgets.md).

A prompt whose answers are right with chance p, a policy of one parameter (p = sigmoid(θ): ∇θ log π is 1 - p for
a right answer, -p for a wrong one, ∇θ p = p(1 - p)), rewards +1 / -1 as the presets' verifiers give. Every outcome
a rule can draw is enumerated by counts, round by round (binomial weights; rollout/budget.py's `decide` itself
decides, the give-up taken with its chance), and the group's estimator Σ_i A_i ∇θ log π(y_i) summed over them with
their probabilities: E[estimator | p] exactly, no sampling. Printed per p:

    w(p) = E[estimator | p] / ∇θ E[r]        how much a prompt of pass rate p weighs in the expected gradient
                                             (fixed G, group-mean baseline, no std: G - 1 for every p)
    n    = E[samples drawn | p]              its generation cost
    kept = P(the group is kept | p)          what dynamic sampling keeps (a group with both outcomes)

Every rule here keeps each prompt's own direction (w > 0: the estimator points along ∇p); what differs is how the
prompts are weighed against each other, and at what cost. Run: `python -m bench.budget_weights`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Literal

from rollout.budget import balanced, decide, pool_stats
from services.schemas import SamplingBudget

Baseline = Literal["group", "pool", "zero"]
EPS = 1e-6


@dataclass(frozen=True)
class Expectation:
    w: float  # E[estimator] / ∇E[r]
    n: float  # E[samples drawn]
    kept: float  # P(both outcomes among the samples trained)


def expectation(
    p: float, g: int, budget: SamplingBudget | None = None, *, std: bool = True, baseline: Baseline | None = None
) -> Expectation:
    """The exact expectation for a prompt of pass rate `p`: `budget` None is `fixed` (g samples, one round).
    `baseline`: "group" (the kept samples' mean), "pool" (every drawn sample's: the balanced rule's default), "zero"
    (none: Wald's identity gives w = n for a rule that keeps what it draws)."""
    if not 0.0 < p < 1.0:
        raise ValueError("p: a pass rate strictly between 0 and 1 (at 0 or 1 there is no gradient)")
    base: Baseline = baseline or ("pool" if budget is not None and budget.rule == "balanced" else "group")
    total_w = total_n = total_kept = 0.0
    for (right, wrong, _given_up), prob in outcomes(p, g, budget).items():
        kr, kw = kept_counts(right, wrong, g, budget)
        total_n += prob * (right + wrong)
        if kr and kw:
            total_kept += prob
        rewards = [1.0] * right + [-1.0] * wrong
        kept_rewards = [1.0] * kr + [-1.0] * kw
        if base == "zero":
            mean, spread = 0.0, 1.0
        else:
            mean, spread = pool_stats(rewards if base == "pool" else kept_rewards)
        if base == "group" and (kr == 0 or kw == 0):
            continue  # a uniform group: every advantage 0
        scale = 1.0 / (spread + EPS) if std else 1.0
        estimator = kr * (1.0 - mean) * scale * (1.0 - p) + kw * (-1.0 - mean) * scale * (-p)
        total_w += prob * estimator
    return Expectation(total_w / (2.0 * p * (1.0 - p)), total_n, total_kept)


def kept_counts(right: int, wrong: int, g: int, budget: SamplingBudget | None) -> tuple[int, int]:
    """(right, wrong) the group trains: all it drew, or the balanced rule's down-sample (rollout/budget.balanced)."""
    if budget is None or budget.rule != "balanced":
        return right, wrong
    accs = [True] * right + [False] * wrong
    kr = sum(accs[i] for i in balanced(accs, g))
    return kr, min(right + wrong, g) - kr


def outcomes(p: float, g: int, budget: SamplingBudget | None) -> dict[tuple[int, int, bool], float]:
    """Every end a group can reach — (right, wrong, given up) — with its probability."""
    if budget is None:
        return {(k, g - k, False): binom(g, k) * p**k * (1 - p) ** (g - k) for k in range(g + 1)}
    return dict(_ends(p, g, budget, 0, 0, 0, budget.first))


@cache
def binom(n: int, k: int) -> float:
    return float(math.comb(n, k))


def _ends(
    p: float, g: int, b: SamplingBudget, right: int, wrong: int, rounds: int, add: int
) -> list[tuple[tuple[int, int, bool], float]]:
    out: dict[tuple[int, int, bool], float] = {}
    for k in range(add + 1):
        prob = binom(add, k) * p**k * (1 - p) ** (add - k)
        r, w = right + k, wrong + add - k
        accs = [True] * r + [False] * w
        stay = decide(b, g, accs, rounds + 1, draw=1.0)  # not given up (a draw above every chance)
        gives = decide(b, g, accs, rounds + 1, draw=0.0).what == "give_up"
        q = b.give_up if gives else 0.0
        if q:
            out[(r, w, True)] = out.get((r, w, True), 0.0) + prob * q
        if stay.what == "more":
            for end, pr in _ends(p, g, b, r, w, rounds + 1, stay.add):
                out[end] = out.get(end, 0.0) + prob * (1 - q) * pr
        elif q < 1.0:
            out[(r, w, False)] = out.get((r, w, False), 0.0) + prob * (1 - q)
    return list(out.items())


RULES: list[tuple[str, SamplingBudget | None]] = [
    ("fixed G=8", None),
    ("signal 2/2/8, give up 0", SamplingBudget(rule="signal", first=2, round=2, most=8, give_up=0.0)),
    ("signal 2/2/8, give up 1", SamplingBudget(rule="signal", first=2, round=2, most=8, give_up=1.0)),
    ("signal 2/2/8, give up q(p)", None),  # the chance its group of 8 is uniform: what a prompt's history predicts
    ("signal 4/4/16, give up 0", SamplingBudget(rule="signal", first=4, round=4, most=16, give_up=0.0)),
    ("balanced 4/4/16, give up 0", SamplingBudget(rule="balanced", first=4, round=4, most=16, give_up=0.0)),
]
PASS_RATES = (0.02, 0.1, 0.3, 0.5, 0.7, 0.9)


def oracle(p: float) -> SamplingBudget:
    """signal 2/2/8 giving up with the chance a group of 8 is uniform at this p (a history that knows p)."""
    return SamplingBudget(rule="signal", first=2, round=2, most=8, give_up=p**8 + (1 - p) ** 8)


def main() -> None:
    print("w = E[estimator | p] / ∇E[r] (std-normalised advantages), n = E[samples drawn], w/n per sample; G = 8")
    print(f"{'rule':28s}" + "".join(f"  p={p:<16}" for p in PASS_RATES))
    for name, budget in RULES:
        cells = []
        for p in PASS_RATES:
            e = expectation(p, 8, oracle(p) if "q(p)" in name else budget)
            cells.append(f"  {e.w:5.2f} {e.n:4.1f} {e.w / e.n:4.2f}  ")
        print(f"{name:28s}" + "".join(cells))
    fixed = [expectation(p, 8) for p in PASS_RATES]
    cells = "".join(f"  {e.w * e.kept:5.2f} {e.n * e.kept:4.1f}       " for e in fixed)
    print(f"{'curriculum, fixed G=8':28s}{cells}  (w and n x P(kept): each prompt dispatched with P(kept))")


if __name__ == "__main__":
    main()
