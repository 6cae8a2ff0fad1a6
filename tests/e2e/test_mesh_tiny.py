"""The whole mesh, as `dapo-mesh up --tiny` runs it: every service a real process, weights broadcast,
and a real Prometheus scraping it with the shipped local config."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.child_process import ROOT
from services.redis_server import free_port

SERVICES = ("reward", "buffer", "learner", "rollout-0")
COUNTERS = {  # one counter per service that must have moved while the mesh ran
    "reward": "dapo_reward_items_total",
    "buffer": "dapo_buffer_prompts_dispatched_total",
    "learner": "dapo_learner_batches_trained_total",
    "rollout-0": "dapo_rollout_samples_total",
}


def prometheus_sees(base: str, seen_up: set[str], seen_counting: set[str]) -> None:
    def query(q: str) -> list[dict]:
        r = httpx.get(f"{base}/api/v1/query", params={"query": q}, timeout=5)
        return r.json()["data"]["result"] if r.status_code == 200 else []

    seen_up |= {s["metric"]["service"] for s in query("up == 1")}
    for service, counter in COUNTERS.items():
        if query(f'{counter}{{service="{service}"}} > 0'):
            seen_counting.add(service)


@pytest.mark.slow
def test_dapo_mesh_up_tiny_with_prometheus(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "DAPO_REDIS_URL"} | {"PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    out = (tmp_path / "up.out").open("w")
    cmd = ["up", "--tiny", "--steps", "3", "--run-dir", str(run_dir), "--linger-s", "8",  # 8 s: > 1 scrape interval
           "--eval-every", "3"]  # fmt: skip
    mesh = subprocess.Popen([sys.executable, "-m", "mesh", *cmd], cwd=ROOT, env=env, stdout=out,
                            stderr=subprocess.STDOUT)  # fmt: skip
    prom = None
    seen_up: set[str] = set()
    seen_counting: set[str] = set()
    try:
        targets = run_dir / "prometheus" / "targets" / "mesh.json"
        if shutil.which("prometheus") or os.environ.get("DAPO_REQUIRE_TOOLS"):  # CI: never without it
            deadline = time.monotonic() + 600
            while not targets.exists():
                assert mesh.poll() is None and time.monotonic() < deadline, "the mesh wrote no Prometheus targets"
                time.sleep(0.5)
            port = free_port()
            prom = subprocess.Popen(["prometheus", f"--config.file={run_dir / 'prometheus' / 'prometheus.yml'}",
                                     f"--web.listen-address=127.0.0.1:{port}",
                                     f"--storage.tsdb.path={tmp_path / 'tsdb'}"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            while mesh.poll() is None:
                try:
                    prometheus_sees(f"http://127.0.0.1:{port}", seen_up, seen_counting)
                except httpx.HTTPError:
                    pass  # not up yet
                time.sleep(2)
        code = mesh.wait(900)
    finally:
        if mesh.poll() is None:
            mesh.kill()
        if prom is not None:
            prom.terminate()
            prom.wait(30)
    stdout = (tmp_path / "up.out").read_text()
    assert code == 0, stdout[-4000:]
    for name in SERVICES:
        assert f"ready: {name}" in stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "train"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["policy_version"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert {"reward_mean", "acc_mean", "entropy", "clip_frac_upper"} <= s.keys()
        assert s["sync_replicas"] == 1  # the replica took every version by broadcast
    evals = [r for r in rows if r["kind"] == "eval"]  # rollout-0: the held-out split at version 0 and 3
    assert [e["policy_version"] for e in evals] == [0, 3] and len(rows) == 5
    for e in evals:
        assert 0.0 <= e["eval_acc"] <= e["eval_pass_at_k"] <= 1.0 and e["eval_prompts"] == 16 and e["eval_k"] == 2
    assert "held-out eval of version 3: avg@2" in stdout
    state = json.loads((run_dir / "learner" / "state.json").read_text())
    assert state["trained"] == [0, 1, 2] and state["version"] == 3
    rollout_log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert "serving weights version 3 (broadcast)" in rollout_log  # the replica followed the learner to the end
    assert "replicas hold the final weights (version 3)" in stdout
    assert (run_dir / "curves.png").stat().st_size > 10_000  # drawn once, when the run ends
    cpu = json.loads((run_dir / "cpu.json").read_text())  # what each process cost, the orchestrator's share
    assert set(SERVICES) <= set(cpu["services_s"]) and all(v > 0 for v in cpu["services_s"].values())
    assert 0 < cpu["orchestrator_share"] < 1 and "CPU: orchestrator" in stdout
    assert cpu["machine"]["cores"] == os.cpu_count() and cpu["machine"]["cpu"]  # what the times were measured on
    if prom is not None:
        assert seen_up == set(SERVICES), f"Prometheus saw up == 1 only for {seen_up}"
        assert seen_counting == set(SERVICES), f"counters moved only for {seen_counting}"
    left = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left behind: {left}"
