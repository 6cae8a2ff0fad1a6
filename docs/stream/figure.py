"""docs/stream/stream.png: held-out avg@4 by version and trained tokens by version lag, for the streaming replica
(keep, drain) and the chunked loop, beside the chunked runs of the seed table.  Run from the repository root:

    .venv/bin/python docs/stream/figure.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RUNS = {
    "streaming, keep (seed 1)": "docs/stream/keep-metrics.jsonl",
    "streaming, drain (seed 1)": "docs/stream/drain-metrics.jsonl",
    "chunked, --no-stream (seed 1, same day)": "docs/stream/chunked-metrics.jsonl",
}
SEED_TABLE = {f"seed table, chunked (seed {s})": f"docs/ablate/dapo-seed{s}/metrics.jsonl" for s in (1, 2, 3)}
COLOURS = ["C0", "C1", "C2"]


def rows(path: str, kind: str) -> list[dict[str, Any]]:
    lines = Path(path).read_text().splitlines()
    return [r for r in (json.loads(x) for x in lines if x.strip()) if r["kind"] == kind]


def main() -> None:
    fig, (curves, lags) = plt.subplots(1, 2, figsize=(11, 4))
    for name, path in SEED_TABLE.items():
        ev = rows(path, "eval")
        curves.plot(
            [r["policy_version"] for r in ev], [r["eval_acc"] for r in ev], color="grey", alpha=0.5, lw=1, label=name
        )
    width = 0.27
    for i, ((name, path), colour) in enumerate(zip(RUNS.items(), COLOURS, strict=True)):
        ev = rows(path, "eval")
        curves.plot([r["policy_version"] for r in ev], [r["eval_acc"] for r in ev], "o-", color=colour, label=name)
        train = rows(path, "train")
        assert all(r["lag"] <= 1 for r in train)  # token lags are then 0 or 1: the mean gives the split exactly
        lag1 = sum(r["token_lag_mean"] * r["response_tokens"] for r in train)
        total = sum(r["response_tokens"] for r in train)
        lags.bar(
            [(i - 1) * width, 1 + (i - 1) * width],
            [(total - lag1) / total, lag1 / total],
            width,
            color=colour,
            label=name,
        )
    curves.set_xlabel("policy version (evaluation begun at)")
    curves.set_ylabel("held-out avg@4")
    curves.legend(fontsize=7)
    curves.grid(alpha=0.3)
    lags.set_xticks([0, 1])
    lags.set_xlabel("version lag of a trained token")
    lags.set_ylabel("share of trained tokens")
    lags.legend(fontsize=7)
    lags.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig("docs/stream/stream.png", dpi=110)


if __name__ == "__main__":
    main()
