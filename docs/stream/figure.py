"""docs/stream/stream.png: held-out avg@4 by version and batches by version lag, the streaming replica (keep, drain)
beside the chunked runs of the seed table."""
import json, sys
from collections import Counter
from pathlib import Path
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

def rows(p):
    return [json.loads(l) for l in Path(p).read_text().splitlines() if l.strip()]

runs = {"streaming, keep (seed 1)": "docs/stream/keep-metrics.jsonl", "streaming, drain (seed 1)": "docs/stream/drain-metrics.jsonl",
        "chunked, --no-stream (seed 1, same day)": "docs/stream/chunked-metrics.jsonl"}
chunked = {f"seed table, chunked (seed {s})": f"docs/ablate/dapo-seed{s}/metrics.jsonl" for s in (1, 2, 3)}
fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
for name, p in chunked.items():
    ev = [r for r in rows(p) if r["kind"] == "eval"]
    a.plot([r["policy_version"] for r in ev], [r["eval_acc"] for r in ev], color="grey", alpha=0.5, lw=1, label=name)
for (name, p), c in zip(runs.items(), ["C0", "C1", "C2"]):
    ev = [r for r in rows(p) if r["kind"] == "eval"]
    a.plot([r["policy_version"] for r in ev], [r["eval_acc"] for r in ev], "o-", color=c, label=name)
a.set_xlabel("policy version (evaluation begun at)"); a.set_ylabel("held-out avg@4"); a.legend(fontsize=7); a.grid(alpha=0.3)
width = 0.27
for i, ((name, p), c) in enumerate(zip(runs.items(), ["C0", "C1", "C2"])):
    train = [r for r in rows(p) if r["kind"] == "train"]
    assert all(r["lag"] <= 1 for r in train)  # token lags are then 0 or 1: the mean gives the split exactly
    lag1 = sum(r["token_lag_mean"] * r["response_tokens"] for r in train)
    total = sum(r["response_tokens"] for r in train)
    b.bar([0 + (i - 1) * width, 1 + (i - 1) * width], [(total - lag1) / total, lag1 / total], width, color=c, label=name)
b.set_xticks([0, 1]); b.set_xlabel("version lag of a trained token")
b.set_ylabel("share of trained tokens"); b.legend(fontsize=7); b.grid(alpha=0.3)
fig.tight_layout(); fig.savefig("docs/stream/stream.png", dpi=110)
print("docs/stream/stream.png")
