"""Training curves of a run as one PNG: `plot(run_dir / "metrics.jsonl", run_dir / "curves.png")`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PANELS = [  # (title, [(key in metrics.jsonl, label)])
    ("reward", [("reward_mean", "batch reward")]),
    (
        "accuracy",
        [("acc_mean", "batch accuracy"), ("eval_acc", "held-out avg@k"), ("eval_pass_at_k", "held-out pass@k")],
    ),
    ("entropy", [("entropy", "token entropy")]),
    ("clip fraction", [("clip_frac_upper", "upper (1+ε_high)"), ("clip_frac_lower", "lower (1−ε_low)")]),
    ("filtered by dynamic sampling", [("filtered_frac", "fraction of groups")]),
    ("seconds per step", [("seconds", "learner"), ("sync_seconds", "weight sync")]),
]
EPISODE_PANELS = [  # drawn when the run trained on episodes (learner/batching.py episode_metrics)
    (
        "episodes",
        [("episode_turns", "model turns per episode"), ("episode_truncated_frac", "truncated (fraction)")],
    ),
    (
        "tool calls per episode; env wait",
        [
            ("tool_calls/valid", "valid"),
            ("tool_calls/malformed", "malformed"),
            ("tool_calls/unknown", "unknown"),
            ("tool_calls/failed", "failed"),
            ("env_wait_frac", "time waiting for env (fraction)"),
        ],
    ),
]


def plot(metrics: Path, out: Path) -> Path | None:
    """Write the curves; None when there is nothing to plot yet."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = PANELS + (EPISODE_PANELS if any("episode_turns" in r for r in rows) else [])
    cols = (len(panels) + 1) // 2
    fig, axes = plt.subplots(2, cols, figsize=(13 * cols / 3, 7), constrained_layout=True)
    per_task = {"accuracy": "eval_acc/", "filtered by dynamic sampling": "filtered_frac/"}  # + a line per task
    keys = sorted({k for r in rows for k in r})
    for ax, (title, series) in zip(axes.flat, panels, strict=True):
        prefix = per_task.get(title)
        extra = [(k, f"{k.split('/', 1)[1]} ({k.split('/', 1)[0]})") for k in keys if prefix and k.startswith(prefix)]
        for key, label in [*series, *extra]:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float) and not math.isnan(r[key])]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("learner step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"dapo-mesh run: {metrics.parent.name}")
    return _save(fig, out)


Curve = list[tuple[float, float]]  # (policy version, value)


def plot_ablation(runs: dict[str, dict[int, tuple[Curve, Curve]]], out: Path) -> Path:
    """`dapo-mesh ablate`'s figure: per preset and seed, held-out avg@k and mean response tokens by policy version
    (thin: each seed; thick: the mean over the seeds at the versions they share)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (preset, seeds) in enumerate(runs.items()):
        colour = colours[i % len(colours)]
        for panel, ax in enumerate(axes):
            curves = [dict(c[panel]) for c in seeds.values()]
            for c in curves:
                ax.plot(list(c), list(c.values()), color=colour, alpha=0.35, linewidth=1)
            shared = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            ax.plot(
                shared,
                [sum(c[v] for c in curves) / len(curves) for v in shared],
                color=colour,
                linewidth=2.5,
                marker="o",
                label=f"{preset} (mean of {len(curves)} seeds)",
            )
    for ax, title in zip(axes, ("held-out avg@k", "mean response tokens (held-out)"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("policy version")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out)


def _save(fig: Any, out: Path) -> Path:
    """Written beside `out`, then renamed: a reader never sees half a PNG."""
    import matplotlib.pyplot as plt

    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(out)
    return out
