"""docs/results/curriculum/curriculum.png: held-out avg@4 by version (each seed, and the mean over seeds), and the
cumulative share of groups dynamic sampling dropped, by learner step, for the DAPO preset on 100 prompts under
`uniform`, the curriculum and the curriculum with GRESO's decaying exploration; docs/results/curriculum/hard.png: the
hard-start preset's held-out avg@4 per task under the curriculum (without and with the class prior) and `uniform`.
It also prints each run's row of the seed table (docs/results/curriculum.md).  Run from the repository root:

    .venv/bin/python docs/results/curriculum/figure.py
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mesh.ablate import dropped_since, metric_rows  # noqa: E402
from mesh.ablate import eval_rows as evals  # noqa: E402
from mesh.ablate import step_rows as steps  # noqa: E402

HERE = Path("docs/results/curriculum")
POLICIES = {"uniform": "uniform", "curriculum (default)": "curriculum", "curriculum, streak decay": "curriculum-streak"}
SEEDS = (1, 2, 3)
# the class prior's run to v45 (hard-class.metrics.jsonl: its first run, 18 steps, in the page's table only)
HARD = {"curriculum": "hard", "uniform": "hard-uniform", "curriculum, class prior": "hard-class45"}


def rows(name: str) -> list[dict[str, Any]]:
    return metric_rows(HERE / f"{name}.metrics.jsonl")


def waste(rs: list[dict[str, Any]], since: dict[str, Any] | None = None) -> tuple[float, float]:
    """(share of scored groups dropped, groups received per group kept), from `since` (a step's row) to the end."""
    return dropped_since(steps(rs), since)


def to_plus(rs: list[dict[str, Any]], points: float = 0.30) -> str:
    """Minutes from the version-0 evaluation to the first one `points` above it (and its version)."""
    ev = evals(rs)
    hit = next((r for r in ev if r["eval_acc"] >= ev[0]["eval_acc"] + points - 1e-9), None)
    return f"{(hit['eval_at'] - ev[0]['eval_at']) / 60:.1f} min (v{hit['policy_version']})" if hit else "not reached"


def table() -> None:
    """The seed table: per run, the share of groups dropped and groups received per group kept (whole run, after
    the 1st pass, steps 37-45), held-out avg@4 at v0, v18, v45, the best, wall time v0 -> v45, to +30 points; per
    policy, the mean ± standard deviation over its seeds."""
    for policy in POLICIES.values():
        runs = [(seed, rs) for seed in SEEDS if (rs := rows(f"{policy}-seed{seed}"))]
        cols: list[list[float]] = []
        for seed, rs in runs:
            ev = {r["policy_version"]: r for r in evals(rs)}
            later = next((r for r in steps(rs) if r.get("epoch", 0) >= 1), None)
            (dw, gw), (da, ga), (dl, gl) = waste(rs), waste(rs, later), waste(rs, steps(rs)[35])
            wall = (ev[45]["eval_at"] - ev[0]["eval_at"]) / 60 if 45 in ev else float("nan")
            best = max(r["eval_acc"] for r in ev.values())
            cols.append([dw, da, dl, gw, ga, gl, ev[45]["eval_acc"], best])
            acc = " → ".join(f"{ev[v]['eval_acc']:.3f}" for v in (0, 18, 45) if v in ev)
            print(
                f"| {policy} | {seed} | {dw:.0%} / {da:.0%} / {dl:.0%} | {gw:.2f} / {ga:.2f} / {gl:.2f} | {acc} | "
                f"{best:.3f} | {wall:.1f} min | {to_plus(rs)} |"
            )
        if len(cols) > 1:
            m = [statistics.fmean(c) for c in zip(*cols, strict=True)]
            sd = [statistics.stdev(c) for c in zip(*cols, strict=True)]
            print(
                f"| **{policy}** | mean ± std of {len(cols)} | {m[0]:.0%} ± {sd[0]:.0%} / {m[1]:.0%} ± {sd[1]:.0%} / "
                f"{m[2]:.0%} ± {sd[2]:.0%} | {m[3]:.2f} / {m[4]:.2f} / {m[5]:.2f} | final {m[6]:.3f} ± {sd[6]:.3f} "
                f"| {m[7]:.3f} ± {sd[7]:.3f} | | |"
            )


def dapo() -> None:
    fig, (acc, drop) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for i, (label, policy) in enumerate(POLICIES.items()):
        color = f"C{i}"
        runs = [rs for seed in SEEDS if (rs := rows(f"{policy}-seed{seed}"))]
        curves = [[(r["policy_version"], r["eval_acc"]) for r in evals(rs)] for rs in runs]
        for c in curves:
            acc.plot(*zip(*c, strict=True), color=color, alpha=0.3, lw=1)
        common = sorted(set.intersection(*({v for v, _ in c} for c in curves)))
        mean = [sum(dict(c)[v] for c in curves) / len(curves) for v in common]
        acc.plot(common, mean, color=color, marker="o", label=f"{label} (mean of {len(runs)})")
        for j, rs in enumerate(runs):
            tr = [(r["step"], r["filtered_frac"]) for r in steps(rs) if "filtered_frac" in r]
            drop.plot(*zip(*tr, strict=True), color=color, alpha=0.7, label=label if j == 0 else None)
    acc.set_title("held-out avg@4 (DAPO preset, 100 training prompts; thin: each seed)")
    acc.set_xlabel("policy version")
    drop.set_title("groups dropped by dynamic sampling (cumulative share, each seed)")
    drop.set_xlabel("learner step")
    for ax in (acc, drop):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(HERE / "curriculum.png", dpi=90)


def hard() -> None:
    fig, (acc, drop) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for style, (policy, name) in zip(("-", "--", ":"), HARD.items(), strict=True):
        rs = rows(name)
        if not rs:
            continue
        ev, tr = evals(rs), steps(rs)
        for i, key in enumerate(sorted({k for r in ev for k in r if k.startswith("eval_acc/")})):
            pts = [(r["policy_version"], r[key]) for r in ev if key in r]
            label = f"{key.split('/', 2)[-1]}, {policy}"
            acc.plot(*zip(*pts, strict=True), style, color=f"C{i}", marker="o", label=label)
        for i, key in enumerate(sorted({k for r in tr for k in r if k.startswith("filtered_frac/")})):
            pts = [(r["step"], r[key]) for r in tr if key in r]
            drop.plot(*zip(*pts, strict=True), style, color=f"C{i}", label=f"{key.split('/', 2)[-1]}, {policy}")
    acc.set_title("hard-start preset: held-out avg@4 per task")
    acc.set_xlabel("policy version")
    drop.set_title("groups dropped by dynamic sampling, per task (cumulative)")
    drop.set_xlabel("learner step")
    for ax in (acc, drop):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(HERE / "hard.png", dpi=90)


if __name__ == "__main__":
    table()
    dapo()
    hard()
