"""Chaos: the tiny mesh runs while a seeded schedule SIGKILLs the learner, the buffer, the reward server,
rollout replicas and Redis itself; the mesh's supervisor restarts them; the run completes and
`dapo-mesh audit` accounts for every dispatched prompt, no batch in the weights twice, no group in
two batches."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.launch import ROOT
from services.common.ledger import read_ledger
from services.mesh.layout import RunLayout

SEED = int(os.environ.get("DAPO_CHAOS_SEED", "20261129"))
STEPS = 30
VICTIMS = ["learner", "buffer", "reward", "rollout-0", "rollout-1", "redis"]


def version(run_dir: Path) -> int:
    return max((e.version for e in read_ledger(RunLayout(run_dir).learner)), default=0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chaos_run_completes_and_the_audit_balances(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "DAPO_REDIS_URL"} | {"PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    out = (tmp_path / "up.out").open("w")
    cmd = [sys.executable, "-m", "services.mesh", "up", "--tiny", "--steps", str(STEPS), "--replicas", "2",
           "--run-dir", str(run_dir)]  # fmt: skip
    mesh = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    rng = random.Random(SEED)
    schedule = VICTIMS[:]  # every kind of service once, in a seeded order, then more seeded picks
    rng.shuffle(schedule)
    schedule += [rng.choice(VICTIMS) for _ in range(3)]
    killed: list[str] = []
    try:
        deadline = time.monotonic() + 600
        while version(run_dir) < 1:  # the mesh is flowing
            assert mesh.poll() is None and time.monotonic() < deadline, (tmp_path / "up.out").read_text()[-3000:]
            time.sleep(0.5)
        for victim in schedule:  # one fault per learner step: the run makes progress between faults
            at = version(run_dir)
            while version(run_dir) == at and mesh.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(rng.uniform(0.0, 1.5))  # a seeded moment inside the next step
            if mesh.poll() is not None or version(run_dir) >= STEPS - 1:
                break
            pid = json.loads((run_dir / "pids.json").read_text())[victim]
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(victim)
            except ProcessLookupError:  # it is being restarted right now
                pass
        code = mesh.wait(600)
    finally:
        if mesh.poll() is None:
            mesh.kill()
    stdout = (tmp_path / "up.out").read_text()
    assert code == 0, stdout[-4000:]
    assert len(set(killed)) >= 5, f"the schedule only reached {killed}"  # the faults really happened
    restarts = [json.loads(x) for x in (run_dir / "supervisor.jsonl").read_text().splitlines()]
    assert sorted({r["service"] for r in restarts}) == sorted(set(killed))
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {s["kind"] for s in steps} == {"train"}  # no --eval-every
    assert [s["policy_version"] for s in steps] == list(range(1, STEPS + 1))

    r = subprocess.run([sys.executable, "-m", "services.mesh", "audit", str(run_dir), "--json"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    report = json.loads(r.stdout)
    print(f"chaos seed {SEED}: killed {killed}; audit {json.dumps(report)}")
    assert r.returncode == 0 and report["balanced"], report
    assert report["vanished"] == [] and report["places"]["vanished"] == 0
    assert report["batches_trained_twice"] == [] and report["groups_in_two_batches"] == []
    assert report["batches_trained"] == STEPS and report["places"]["trained"] >= STEPS * 4  # B = 4 in --tiny
    assert sum(report["places"].values()) == report["dispatched"] > 0
    left = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left behind: {left}"
