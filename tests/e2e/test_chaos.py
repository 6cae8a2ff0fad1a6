"""Chaos: the tiny mesh runs while a seeded schedule SIGKILLs the learner, the buffer, the reward server,
rollout replicas and Redis itself; the mesh's supervisor restarts them; the run completes and
`dapo-mesh audit` accounts for every dispatched prompt, no batch in the weights twice, no group in
two batches, and the buffer's per-prompt pass-rate state counts every group it took in once."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
import redis

from services.streams import GROUP_BUFFER, STREAM_ROLLOUTS
from tests.e2e.meshrun import audit, left_behind, start_mesh, version

SEED = int(os.environ.get("DAPO_CHAOS_SEED", "20261129"))
STEPS = 30
VICTIMS = ["learner", "buffer", "reward", "rollout-0", "rollout-1", "redis"]


def holding(run_dir: Path, wait_s: float = 10.0) -> bool:
    """Wait (up to wait_s) until the buffer holds scored groups it has read and not acknowledged; False if it never
    did (or Redis was down)."""
    port = re.search(r"^port (\d+)", (run_dir / "redis" / "redis.conf").read_text(), re.M)
    client = redis.Redis(port=int(port[1]) if port else 6379, socket_timeout=2)
    end = time.monotonic() + wait_s
    try:
        while time.monotonic() < end:
            if client.xpending(STREAM_ROLLOUTS, GROUP_BUFFER)["pending"]:
                return True
            time.sleep(0.02)
    except redis.RedisError:
        pass
    finally:
        client.close()
    return False


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chaos_run_completes_and_the_audit_balances(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    mesh = start_mesh(tmp_path, "--steps", str(STEPS), "--replicas", "2")
    rng = random.Random(SEED)
    schedule = VICTIMS[:]  # every kind of service once, in a seeded order, then more seeded picks
    rng.shuffle(schedule)
    schedule += [rng.choice(VICTIMS) for _ in range(3)]
    killed: list[str] = []
    held: list[bool] = []
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
            if victim == "buffer":  # ... at which it holds groups (counted in their prompts' state, not yet batched):
                held.append(holding(run_dir))  # its successor reads them again: neither lost nor counted twice
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
    assert "buffer" not in killed or any(held), "the buffer was never killed while it held groups"
    restarts = [json.loads(x) for x in (run_dir / "supervisor.jsonl").read_text().splitlines()]
    assert sorted({r["service"] for r in restarts}) == sorted(set(killed))
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {s["kind"] for s in steps} == {"train"}  # no --eval-every
    assert [s["policy_version"] for s in steps] == list(range(1, STEPS + 1))

    code, report = audit(run_dir)
    print(f"chaos seed {SEED}: killed {killed}; audit {json.dumps(report)}")
    assert code == 0 and report["balanced"], report
    assert report["vanished"] == [] and report["places"]["vanished"] == 0
    assert report["batches_trained_twice"] == [] and report["groups_in_two_batches"] == []
    assert report["state_miscounted"] == [] and report["state_checked"] > 0  # the curriculum's state (kept under
    # either dispatch policy) survived the buffer's and Redis's kills: no group lost from it or counted twice
    assert report["batches_trained"] == STEPS and report["places"]["trained"] >= STEPS * 4  # B = 4 in --tiny
    assert sum(report["places"].values()) == report["dispatched"] > 0
    assert (left := left_behind(run_dir)) == [], f"processes left behind: {left}"
