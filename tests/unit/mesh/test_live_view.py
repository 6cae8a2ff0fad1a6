"""The live view's numbers and the run's curves, from synthetic service states (no processes)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console

from mesh import curves
from mesh.live import LiveView, ServiceState, mesh_numbers
from mesh.recorder import row as metrics_row
from services.schemas import LedgerEntry


def states() -> list[ServiceState]:
    buffer = ServiceState("buffer", 1, True, True, "running", {
        "dapo_buffer_groups_received_total": [({}, 40.0)], "dapo_buffer_groups_kept_total": [({}, 10.0)],
        "dapo_buffer_version_lag_sum": [({}, 6.0)], "dapo_buffer_version_lag_count": [({}, 10.0)],
    })  # fmt: skip
    r0 = ServiceState("rollout-0", 2, True, True, "ready", {"dapo_rollout_tokens_per_second": [({}, 100.0)],
                                                            "dapo_rollout_weight_version": [({}, 7.0)]})  # fmt: skip
    r1 = ServiceState("rollout-1", 3, True, True, "ready", {"dapo_rollout_tokens_per_second": [({}, 50.0)],
                                                            "dapo_rollout_weight_version": [({}, 6.0)]})  # fmt: skip
    learner = ServiceState("learner", 4, False, False, "exited")
    return [buffer, r0, r1, learner]


def test_mesh_numbers() -> None:
    n = mesh_numbers(states())
    assert n["filtered_frac"] == 0.75 and n["version_lag_mean"] == 0.6
    assert n["rollout_tokens_per_s"] == 150.0 and n["replica_version_min"] == 6.0
    assert math.isnan(n["sync_seconds_mean"])  # no learner metrics: unknown, not zero
    assert math.isnan(mesh_numbers([])["filtered_frac"])


def test_metrics_row_and_view(tmp_path: Path) -> None:
    entry = LedgerEntry(batch_id=4, version=5, pid=1, lag=0, task_ids=["t1"], metrics={
        "reward_mean": 0.25, "acc_mean": 0.5, "entropy": 1.2, "clip_frac_upper": 0.01, "seconds": 3.0,
        "behav_kl": 0.0123})  # fmt: skip
    row = metrics_row(entry, states())
    assert row["step"] == 5 and row["policy_version"] == 5 and "version" not in row and "pid" not in row
    assert "task_ids" not in row and row["batch_id"] == 4 and row["reward_mean"] == 0.25
    assert row["filtered_frac"] == 0.75 and "sync_seconds_mean" not in row  # NaNs are left out of the JSON
    json.dumps(row, allow_nan=False)
    view = LiveView(steps=10)
    view.update(states(), row, 5)
    console = Console(record=True, width=160)
    console.print(view.render())
    text = console.export_text()
    assert "5/10" in text and "+0.250" in text and "75%" in text and "exited" in text and "rollout-1" in text
    assert "behav KL" in text and "0.0123" in text


def test_curves_png(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    assert curves.plot(metrics, tmp_path / "c.png") is None  # nothing yet
    rows = [{"step": i, "reward_mean": i / 10, "acc_mean": i / 20, "entropy": 1.0, "seconds": 2.0,
             "filtered_frac": float("nan")} for i in range(1, 4)]  # fmt: skip
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = curves.plot(metrics, tmp_path / "c.png")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
