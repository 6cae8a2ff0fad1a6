"""The whole mesh, as `dapo-mesh up --tiny` runs it: every service a real process, weights synced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.launch import ROOT


@pytest.mark.slow
def test_dapo_mesh_up_tiny(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "DAPO_REDIS_URL"} | {"PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    r = subprocess.run([sys.executable, "-m", "services.cli", "up", "--tiny", "--run-dir", str(run_dir)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name in ("reward", "buffer", "learner", "rollout-0"):
        assert f"ready: {name}" in r.stdout
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == [1, 2, 3]
    state = json.loads((run_dir / "learner" / "state.json").read_text())
    assert state["trained"] == [0, 1, 2] and state["version"] == 3
    rollout_log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert "loaded weights version 3" in rollout_log  # the replica followed the learner to the end
    assert "replicas hold the final weights (version 3)" in r.stdout
    left = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left behind: {left}"
