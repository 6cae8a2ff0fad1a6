"""The whole mesh on environment tasks, as `dapo-mesh up --tiny --set mesh.dataset="env:retry"` runs it: the mesh
starts the environment service beside the others, the buffer dispatches the environment's tasks, the replica runs
their episodes against it and publishes them as groups, the learner trains on the model's tokens, the held-out
evaluation runs episodes, and the audit accounts for every task."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from mesh.layout import RunLayout
from services.ledger import read_ledger
from tests.e2e.meshrun import audit, left_behind, start_mesh


@pytest.mark.slow
def test_dapo_mesh_up_trains_on_episodes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    mesh = start_mesh(tmp_path, "--steps", "3", "--eval-every", "3", "--set", 'mesh.dataset="env:retry"',
                      "--set", "rollout.max_episode_tokens=200")  # fmt: skip
    try:
        code = mesh.wait(900)
    finally:
        if mesh.poll() is None:
            mesh.kill()
    stdout = (tmp_path / "up.out").read_text()
    assert code == 0, stdout[-4000:]
    for name in ("reward", "env", "buffer", "learner", "rollout-0"):
        assert f"ready: {name}" in stdout
    trained = read_ledger(RunLayout(run_dir).learner)
    assert [e.version for e in trained] == [1, 2, 3]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [e["policy_version"] for e in evals] == [0, 3]  # held-out episodes, by the replica
    env_log = (run_dir / "logs" / "env.log").read_text()
    assert "Application startup complete" in env_log
    rollout_log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert "dead-lettered" not in rollout_log and "Traceback" not in rollout_log
    code, report = audit(run_dir)
    assert code == 0, report
    time.sleep(1)
    assert left_behind(run_dir) == []


@pytest.mark.slow
def test_dapo_mesh_up_trains_against_your_own_environment_server(tmp_path: Path) -> None:
    """An environment server written from the docs alone (tests/integration/third_party_env.py: the standard
    library, nothing of dapo-mesh), on its own port behind its own token, named by URL: `dapo-mesh up` trains on its
    environment and evaluates on it, without starting an environment service of its own, and the audit balances."""
    from tests.integration import third_party_env

    run_dir = tmp_path / "run"
    with third_party_env.serve(name="guess", token="theirs") as url:
        servers = f'mesh.env_servers=[{{url="{url}", token_env="GUESS_TOKEN"}}]'
        mesh = start_mesh(tmp_path, "--steps", "3", "--eval-every", "3", "--set", 'mesh.dataset="env:guess"',
                          "--set", servers, env={"GUESS_TOKEN": "theirs"})  # fmt: skip
        try:
            code = mesh.wait(900)
        finally:
            if mesh.poll() is None:
                mesh.kill()
        stats = httpx.get(f"{url}/debug/stats", headers={"Authorization": "Bearer theirs"}, timeout=10).json()
    stdout = (tmp_path / "up.out").read_text()
    assert code == 0, stdout[-4000:]
    assert f"env server {url}: guess" in stdout and "ready: env" not in stdout  # no environment service of its own
    assert stats["resets"] >= 3 * 4 * 4 and stats["steps"] >= stats["resets"]  # 3 batches of 4 groups of 4 episodes
    assert [e.version for e in read_ledger(RunLayout(run_dir).learner)] == [1, 2, 3]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows if r["kind"] == "eval"] == [0, 3]  # held-out episodes on its server
    assert "theirs" not in stdout and "theirs" not in (run_dir / "logs" / "rollout-0.log").read_text()
    code, report = audit(run_dir)
    assert code == 0, report
