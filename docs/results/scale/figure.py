"""docs/results/scale/scale.png: CPU seconds per 1,000 groups of the buffer, Redis and the reward server, and the
weight pickup latency, against the number of simulated replicas (bench/simulate.py), before and after the fixes of
docs/results/scale.md. Run from the repository root:

    .venv/bin/python docs/results/scale/figure.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path("docs/results/scale")
SERIES = {  # label: (rows, line style)
    "Redis 6.2, before": (HERE / "redis62-before.json", ":"),
    "Redis 6.2, after": (HERE / "redis62-after.json", "-."),
    "Redis 7, snapshots": (HERE / "redis7-snapshots.json", "-"),
    "Redis 7, broadcast": (HERE / "redis7-broadcast.json", "--"),
}
PARTS = {
    "cpu_buffer_per_1k": ("buffer", "C0"),
    "cpu_redis_per_1k": ("Redis", "C1"),
    "cpu_reward_per_1k": ("reward server", "C2"),
}


def rows(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text()) if path.exists() else []


def main() -> None:
    fig, (cost, pick) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for label, (path, style) in SERIES.items():
        rs = sorted(rows(path), key=lambda r: r["replicas"])
        if not rs:
            continue
        n = [r["replicas"] for r in rs]
        for key, (part, color) in PARTS.items():
            cost.plot(n, [r[key] for r in rs], style, color=color, marker="o", label=f"{part}, {label}")
        if label.startswith("Redis 7"):
            pick.plot(n, [r["pickup_p50_s"] for r in rs], style, color="C0", marker="o", label=f"p50, {label}")
            pick.plot(n, [r["pickup_p99_s"] for r in rs], style, color="C3", marker="x", label=f"p99, {label}")
            pick.plot(n, [r["pickup_bound_s"] for r in rs], style, color="grey", label=f"bound, {label}")
    cost.set(
        xscale="log",
        xlabel="simulated replicas N",
        ylabel="CPU seconds per 1,000 groups",
        title="control-plane cost per group (32 groups/s offered at every N)",
    )
    pick.set(
        xscale="log",
        yscale="log",
        xlabel="simulated replicas N",
        ylabel="seconds",
        title="new version announced -> replica serving it",
    )
    cost.legend(fontsize=7)
    pick.legend(fontsize=7)
    fig.savefig(HERE / "scale.png", dpi=110)


if __name__ == "__main__":
    main()
