"""`kill PID` of `dapo-mesh up` stops the mesh as Ctrl-C does: every service and the embedded Redis are gone after
it (SIGTERM used to end the orchestrator alone and leave the learner and the replicas running), and the command
exits 0 — a stop asked for is a success (it exited 1)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.meshrun import left_behind, start_mesh, version


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_stops_every_service(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    mesh = start_mesh(tmp_path, "--steps", "500")
    try:
        deadline = time.monotonic() + 300
        while version(run_dir) < 1:  # every service up and the mesh flowing
            assert mesh.poll() is None and time.monotonic() < deadline, (tmp_path / "up.out").read_text()[-3000:]
            time.sleep(0.5)
        assert left_behind(run_dir)  # the services run, named by their run directory
        mesh.send_signal(signal.SIGTERM)
        assert mesh.wait(120) == 0
    finally:
        if mesh.poll() is None:
            mesh.kill()
    deadline = time.monotonic() + 30
    while left_behind(run_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    orphans = left_behind(run_dir)
    for pid in orphans:  # stop what the test started, whatever the outcome
        os.kill(int(pid), signal.SIGKILL)
    assert orphans == [] and "stopping" in (tmp_path / "up.out").read_text()
