"""A one-process learner picks its store's port itself; when another process takes that port before the store
listens on it (on a loaded machine, a replica's engine starting beside it did), the learner picks another and
starts — it exited with EADDRINUSE before, failing `dapo-mesh up`. Real DeepSpeed and TCPStore, in a child process
(the test process may hold a process group already); the port is taken by a real listening socket."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from services.child_process import DIST_ENV

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import os, socket
import torch.distributed as dist
import learner.trainer as trainer

held = socket.socket()
held.bind(("127.0.0.1", 0))
held.listen()
taken = held.getsockname()[1]
picks = iter([taken])  # the first port picked is one another process listens on by now
real = trainer.free_port
trainer.free_port = lambda: next(picks, None) or real()
trainer.init_distributed(timeout_s=60)
print(taken, os.environ["MASTER_PORT"], dist.is_initialized(), dist.get_world_size())
"""


def test_a_store_port_taken_before_the_learner_listens_is_picked_again() -> None:
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV} | {"PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    taken, used, initialized, world = r.stdout.split()[-4:]
    assert used != taken and (initialized, world) == ("True", "1"), r.stdout
    assert "was taken before the learner listened on it" in r.stderr
