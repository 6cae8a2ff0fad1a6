"""Each service's command line for a mesh config: a pure function, so what `dapo-mesh up` starts can be read
and tested without starting anything.

    ports = allocate_ports(cfg)                                   # the only side effect: free ports
    for cmd in service_commands(cfg, model_dir, redis_url, ports):
        subprocess.Popen(cmd.argv(), env=child_env(**cmd.env))    # mesh/supervisor.py does this

A service's flags are the mesh's own first, then the preset's section for that service (`cfg.extra`), so the
preset wins. The Redis URL travels in the environment (DAPO_REDIS_URL), not on the command line, where `ps`
would show a password. The order is the start order: the reward server and the buffer before the learner and
the replicas that need them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from mesh.config import MeshConfig, Service
from mesh.layout import RunLayout
from services.redis_server import free_port

MODULES = {"reward": "reward_server", "buffer": "buffer", "learner": "learner", "rollout": "rollout"}
SYNC_PORT = "sync"  # the learner's weight-sync rendezvous, in the ports mapping beside the services' HTTP ports


@dataclass(frozen=True)
class ServiceCommand:
    name: str  # reward, buffer, learner, rollout-0, rollout-1, ...
    args: tuple[str, ...]  # after `python -m <module>`
    env: dict[str, str] = field(default_factory=dict)  # added to the mesh's own environment

    @property
    def service(self) -> Service:
        """reward, buffer, learner or rollout: the preset section and the package."""
        return _service(self.name)

    @property
    def module(self) -> str:
        return MODULES[self.service]

    def argv(self, python: str = sys.executable) -> list[str]:
        return [python, "-m", self.module, *self.args]


def service_names(cfg: MeshConfig) -> list[str]:
    return ["reward", "buffer", "learner", *(f"rollout-{i}" for i in range(cfg.replicas))]


def allocate_ports(cfg: MeshConfig) -> dict[str, int]:
    return {name: free_port() for name in [*service_names(cfg), SYNC_PORT]}


def service_commands(
    cfg: MeshConfig, model_dir: Path, redis_url: str, ports: Mapping[str, int]
) -> list[ServiceCommand]:
    run = RunLayout(cfg.run_dir)
    broadcast = cfg.transport == "broadcast"
    flags: dict[str, list[str]] = {
        "reward": ["--workers", "1"],
        "buffer": [
            "--run-dir",
            str(run.buffer),
            "--dataset",
            cfg.dataset,
            "--n-samples",
            str(cfg.n_samples),
            "--batch-size",
            str(cfg.batch_size),
            "--max-staleness",
            str(cfg.max_staleness),
        ],
        "learner": [
            "--model-dir",
            str(model_dir),
            "--run-dir",
            str(run.learner),
            "--max-batches",
            str(cfg.steps),
            "--minibatches",
            str(cfg.minibatches),
            "--lr",
            str(cfg.lr),
            "--dtype",
            cfg.dtype,
            "--weight-sync",
            "broadcast" if broadcast else "none",
            "--sync-port",
            str(ports[SYNC_PORT]),
            "--max-staleness",
            str(cfg.max_staleness),
            "--hold-after-max",
            "--ranks",
            str(cfg.learner_ranks),
        ],
    }
    for i in range(cfg.replicas):
        flags[f"rollout-{i}"] = [
            "--engine",
            cfg.engine,
            "--model-dir",
            str(model_dir),
            "--reward-url",
            f"http://127.0.0.1:{ports['reward']}",
            "--weights-dir",
            str(run.snapshots),
            "--replica-id",
            f"rollout-{i}",
            "--max-response-tokens",
            str(cfg.max_response_tokens),
            "--sync-broadcast" if broadcast else "--no-sync-broadcast",
            "--dtype",
            cfg.dtype,
        ]
        if cfg.eval_every and i == 0:  # rollout-0 evaluates the held-out split the buffer wrote
            flags["rollout-0"] += [
                "--eval-every",
                str(cfg.eval_every),
                "--eval-data",
                str(run.eval_items),
                "--eval-size",
                str(cfg.eval_size),
                "--eval-k",
                str(cfg.eval_k),
            ]
    if cfg.seed is not None:  # before the preset's flags: a preset may still set its own
        flags["buffer"] += ["--shuffle-seed", str(cfg.seed)]
        flags["learner"] += ["--seed", str(cfg.seed)]
        for i in range(cfg.replicas):
            flags[f"rollout-{i}"] += ["--seed", str(cfg.seed + i)]  # replicas must not repeat each other
    if cfg.placement == "split" and (cores := split_cores()) is not None:
        flags["learner"] += ["--cpu-cores", cores[0]]
        for i in range(cfg.replicas):
            flags[f"rollout-{i}"] += ["--cpu-cores", cores[1]]
    env = {"DAPO_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    return [
        ServiceCommand(name, ("--port", str(ports[name]), *flags[name], *cfg.extra.get(_service(name), [])), env)
        for name in service_names(cfg)
    ]


def split_cores(cores: set[int] | None = None) -> tuple[str, str] | None:
    """The learner's cores and the replicas': the first half and the rest of the cores this process may use
    (None on one core: nothing to split)."""
    ordered = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if len(ordered) < 2:
        return None
    half = len(ordered) // 2
    return ",".join(map(str, ordered[:half])), ",".join(map(str, ordered[half:]))


def _service(name: str) -> Service:
    return cast(Service, name.split("-")[0])  # service_names() makes every name from a Service
