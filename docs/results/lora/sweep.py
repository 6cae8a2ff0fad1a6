"""The LoRA preset's rank / learning-rate sweep (docs/results/lora.md#rank-and-learning-rate): a table of held-out
avg@4 by version, the learner's seconds per batch and the run's wall time, and docs/results/lora/sweep.png, from
the runs' metrics.jsonl (copied beside this file as sweep/<run>.metrics.jsonl, with sweep/<run>.cpu.json; `dapo` is
the full fine-tuning preset, 18 steps, the same machine). Run from the repository root after

    dapo-mesh ablate --presets configs/lora-sweep/r32-lr2e-4.toml,configs/lora-sweep/r8-lr2e-4.toml,\\
        configs/lora-sweep/r128-lr2e-4.toml,configs/lora-sweep/r32-lr5e-4.toml,configs/lora-sweep/r32-lr1e-4.toml \\
        --seeds 1 --steps 18 --run-dir .dapo/lora-sweep
    dapo-mesh ablate --presets configs/dapo.toml --seeds 1 --steps 18 --run-dir .dapo/lora-sweep

    .venv/bin/python docs/results/lora/sweep.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path("docs/results/lora")
LABELS = {"dapo": "full fine-tuning, lr 2e-5"}


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def summary(path: Path) -> dict[str, Any]:
    rs = rows(path)
    evals = {r["policy_version"]: r for r in rs if r.get("kind") == "eval"}
    train = [r for r in rs if r.get("kind") == "train"]
    cpu = path.with_name(path.name.replace(".metrics.jsonl", ".cpu.json"))
    return {
        "run": LABELS.get(name := path.name.removesuffix("-seed1.metrics.jsonl"), f"LoRA {name}"),
        "acc": {v: e["eval_acc"] for v, e in sorted(evals.items())},
        "pass": {v: e["eval_pass_at_k"] for v, e in sorted(evals.items())},
        "token_version": {v: e.get("eval_mean_token_version") for v, e in sorted(evals.items())},
        "s_per_batch": sum(r["seconds"] for r in train) / max(1, len(train)),
        "filtered": sum(r.get("filtered_frac", 0.0) for r in train) / max(1, len(train)),
        "wall_min": json.loads(cpu.read_text())["wall_s"] / 60 if cpu.exists() else float("nan"),
    }


def main() -> None:
    runs = [summary(p) for p in sorted((HERE / "sweep").glob("*.metrics.jsonl"))]
    print("| run | avg@4 v0 → v9 → v18 | pass@4 v18 | learner s/batch | filtered | wall (min) |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        accs = " → ".join(f"{a:.3f}" for a in r["acc"].values())
        print(
            f"| {r['run']} | {accs} | {r['pass'].get(18, float('nan')):.2f} | {r['s_per_batch']:.1f} | "
            f"{r['filtered']:.0%} | {r['wall_min']:.1f} |"
        )
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    for r in runs:
        ax.plot(list(r["acc"]), list(r["acc"].values()), marker="o", label=r["run"])
    ax.set_title("LoRA sweep: held-out avg@4 by policy version (DAPO preset, seed 1, 18 steps)")
    ax.set_xlabel("policy version")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(HERE / "sweep.png", dpi=90)


if __name__ == "__main__":
    main()
