"""docs/results/lora/lora.png: held-out avg@4 by policy version, and the learner's seconds per batch, for the LoRA
preset (configs/dapo-lora.toml, seed 1, this page's run) beside the full fine-tuning preset on the same machine (9
steps) and its seed-1 run of the seed table (docs/ablate/dapo-seed1, measured on an earlier machine). Run from the
repository root:

    .venv/bin/python docs/results/lora/figure.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path("docs/results/lora")
RUNS = {
    "LoRA rank 32, lr 2e-4 (fp32, this machine)": HERE / "lora-seed1.metrics.jsonl",
    "full fine-tuning, lr 2e-5 (fp32, this machine, 9 steps)": HERE / "full-seed1-9steps.metrics.jsonl",
    "full fine-tuning, lr 2e-5 (bf16, an earlier AMX machine)": Path("docs/ablate/dapo-seed1/metrics.jsonl"),
}


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def main() -> None:
    fig, (acc, secs) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for label, path in RUNS.items():
        rs = rows(path)
        ev = sorted((r["policy_version"], r["eval_acc"]) for r in rs if r.get("kind") == "eval")
        if ev:
            acc.plot(*zip(*ev, strict=True), marker="o", label=label)
        tr = [(r["policy_version"], r["seconds"]) for r in rs if r.get("kind") == "train"]
        if tr:
            secs.plot(*zip(*tr, strict=True), label=label)
    acc.set_title("held-out avg@4 (DAPO preset, seed 1)")
    acc.set_xlabel("policy version")
    secs.set_title("learner seconds per batch (the learner's core, beside a replica)")
    secs.set_xlabel("policy version")
    for ax in (acc, secs):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(HERE / "lora.png", dpi=90)


if __name__ == "__main__":
    main()
