"""What the end-to-end tests share: a tiny mesh started as `dapo-mesh up`, its progress, its audit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from mesh.layout import RunLayout
from services.child_process import ROOT
from services.ledger import read_ledger

ENV = {k: v for k, v in os.environ.items() if k != "DAPO_REDIS_URL"} | {"PYTHONPATH": str(ROOT), "COLUMNS": "200"}


def start_mesh(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`dapo-mesh up --tiny --run-dir TMP/run FLAGS`, its output in TMP/up.out; `env`: more environment."""
    out = (tmp_path / "up.out").open("w")
    cmd = [sys.executable, "-m", "mesh", "up", "--tiny", "--run-dir", str(tmp_path / "run"), *flags]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV | (env or {}), stdout=out, stderr=subprocess.STDOUT)


def version(run_dir: Path) -> int:
    """The newest version in the learner's ledger (0 before the first batch)."""
    return max((e.version for e in read_ledger(RunLayout(run_dir).learner)), default=0)


def audit(run_dir: Path) -> tuple[int, dict[str, Any]]:
    """`dapo-mesh audit RUN_DIR --json`: (exit code, report)."""
    r = subprocess.run([sys.executable, "-m", "mesh", "audit", str(run_dir), "--json"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    return r.returncode, json.loads(r.stdout)


def left_behind(run_dir: Path) -> list[str]:
    """PIDs of processes whose command line names the run directory."""
    return subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
