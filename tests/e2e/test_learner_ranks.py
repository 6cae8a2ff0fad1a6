"""A two-rank learner in the tiny mesh (`dapo-mesh up --learner-ranks 2`, torchrun): SIGKILL of rank 1 mid-step
stops the whole learner (torchrun), the mesh's supervisor restarts it, it resumes from its checkpoint, the run
finishes, and `dapo-mesh audit` finds every batch trained once and nothing lost; no process is left behind."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from mesh.layout import RunLayout
from services.ledger import read_ledger
from tests.e2e.meshrun import audit, left_behind, start_mesh, version

STEPS = 8


def rank_pid(run_dir: Path, rank: int) -> int | None:
    """The learner process of `rank` (torchrun's worker: RANK in its environment) of this run."""
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or str(run_dir).encode() not in (proc / "cmdline").read_bytes():
                continue
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_WORLD_SIZE=2" in env:
            return int(proc.name)
    return None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killing_one_learner_rank_loses_nothing_and_trains_nothing_twice(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    mesh = start_mesh(tmp_path, "--steps", str(STEPS), "--learner-ranks", "2")
    try:
        deadline = time.monotonic() + 400
        while version(run_dir) < 2:  # the mesh is flowing, two checkpointed batches
            assert mesh.poll() is None and time.monotonic() < deadline, (tmp_path / "up.out").read_text()[-3000:]
            time.sleep(0.2)
        at = version(run_dir)
        while version(run_dir) == at:  # the next batch has just been trained: kill inside the one after it
            assert mesh.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        pid = rank_pid(run_dir, 1)
        assert pid is not None, "no rank-1 learner process"
        os.kill(pid, signal.SIGKILL)
        killed_at = version(run_dir)
        code = mesh.wait(400)
    finally:
        if mesh.poll() is None:
            mesh.kill()
    stdout = (tmp_path / "up.out").read_text()
    assert code == 0, stdout[-4000:]
    assert killed_at < STEPS
    restarts = [json.loads(x) for x in (run_dir / "supervisor.jsonl").read_text().splitlines()]
    assert [r["service"] for r in restarts] == ["learner"]  # the whole learner, restarted once
    log = (run_dir / "logs" / "learner.log").read_text()
    assert log.count("rank 1 of 2: following rank 0") == 2  # both starts had two ranks
    assert [e.version for e in read_ledger(RunLayout(run_dir).learner)][-1] == STEPS

    code, report = audit(run_dir)
    assert code == 0 and report["balanced"], report
    assert report["batches_trained_twice"] == [] and report["groups_in_two_batches"] == []
    assert report["batches_trained"] == STEPS and report["places"]["vanished"] == 0
    assert (left := left_behind(run_dir)) == [], f"processes left behind: {left}"
