"""docs/results/curriculum/curriculum.png: held-out avg@4 by version, and the cumulative share of groups dynamic
sampling dropped, by learner step, for the DAPO preset on 100 prompts under `uniform`, the curriculum and the
curriculum with GRESO's decaying exploration; and docs/results/curriculum/hard.png: the hard-start preset's held-out
avg@4 per task.  Run from the repository root:

    .venv/bin/python docs/results/curriculum/figure.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path("docs/results/curriculum")
RUNS = {
    "uniform": "uniform-seed1",
    "curriculum (default)": "curriculum-seed1",
    "curriculum, streak decay": "curriculum-streak-seed1",
}


def rows(name: str) -> list[dict[str, Any]]:
    path = HERE / f"{name}.metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def dapo() -> None:
    fig, (acc, waste) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for label, name in RUNS.items():
        rs = rows(name)
        ev = sorted((r["policy_version"], r["eval_acc"]) for r in rs if r.get("kind") == "eval")
        acc.plot(*zip(*ev, strict=True), marker="o", label=label)
        tr = [(r["step"], r["filtered_frac"]) for r in rs if r.get("kind") != "eval" and "filtered_frac" in r]
        waste.plot(*zip(*tr, strict=True), label=label)
    acc.set_title("held-out avg@4 (DAPO preset, 100 training prompts, seed 1)")
    acc.set_xlabel("policy version")
    waste.set_title("groups dropped by dynamic sampling (cumulative share)")
    waste.set_xlabel("learner step")
    for ax in (acc, waste):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(HERE / "curriculum.png", dpi=90)


def hard() -> None:
    rs = rows("hard")
    if not rs:
        return
    fig, (acc, waste) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    ev = sorted((r for r in rs if r.get("kind") == "eval"), key=lambda r: r["policy_version"])
    for key in sorted({k for r in ev for k in r if k.startswith("eval_acc/")}):
        pts = [(r["policy_version"], r[key]) for r in ev if key in r]
        acc.plot(*zip(*pts, strict=True), marker="o", label=key.split("/", 2)[-1])
    tr = [r for r in rs if r.get("kind") != "eval"]
    for key in sorted({k for r in tr for k in r if k.startswith("filtered_frac/")}):
        pts = [(r["step"], r[key]) for r in tr if key in r]
        waste.plot(*zip(*pts, strict=True), label=key.split("/", 2)[-1])
    acc.set_title("hard-start preset: held-out avg@4 per task")
    acc.set_xlabel("policy version")
    waste.set_title("groups dropped by dynamic sampling, per task (cumulative)")
    waste.set_xlabel("learner step")
    for ax in (acc, waste):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(HERE / "hard.png", dpi=90)


if __name__ == "__main__":
    dapo()
    hard()
