"""Each service's command line for a mesh config: a pure function, so what `dapo-mesh up` starts can be read
and tested without starting anything.

    ports = allocate_ports(cfg, routes)                           # the only side effect: free ports
    for cmd in service_commands(cfg, model_dir, redis_url, ports, routes):   # routes: mesh/envs.py
        subprocess.Popen(cmd.argv(), env=child_env(**cmd.env))    # mesh/supervisor.py does this

A service's settings are the mesh's values (ports, paths, what [mesh] decides for every service: MESH_SETS in
mesh/config.py) and its typed preset section (`cfg.learner`, ...), which may not set a MESH_SETS name: each value
has one place, and the command line is written once, here. The Redis URL travels in the environment
(DAPO_REDIS_URL), not on the command line, where `ps` would show a password, as do the tokens of the user's own
environment servers (DAPO_ENV_ROUTE_TOKENS, the replicas' only). The order is the start order: the reward server and
the buffer before the learner and the replicas that need them. The mesh's own environment service runs when the
dataset has an `env:` part that no server of the user's (`routes`) serves.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from mesh.config import MeshConfig, Service, to_flags
from mesh.envs import EnvRoutes
from mesh.layout import RunLayout
from services.datasets import env_names, file_verifiers
from services.redis_server import free_port

MODULES = {
    "reward": "reward_server",
    "env": "env_server",
    "buffer": "buffer",
    "learner": "learner",
    "rollout": "rollout",
    "router": "router",
    "sandbox": "sandbox",
}
CODE = "code"  # the verifier that needs the sandbox service (reward_server/verifiers/code.py)
SANDBOXED_ENVS = {"compute"}  # the built-in environments whose tool runs in it (env_server/builtins/compute.py)
SYNC_PORT = "sync"  # the learner's weight-sync rendezvous, in the ports mapping beside the services' HTTP ports
DIST_PORT = "dist"  # a one-process learner's torch.distributed store (picked here: never one of the services')


@dataclass(frozen=True)
class ServiceCommand:
    name: str  # reward, env, buffer, learner, rollout-0, rollout-1, ...
    args: tuple[str, ...]  # after `python -m <module>`
    env: dict[str, str] = field(default_factory=dict, repr=False)  # added to the mesh's own (secrets: never shown)

    @property
    def service(self) -> Service:
        """reward, env, buffer, learner or rollout: the preset section and the package."""
        return _service(self.name)

    @property
    def module(self) -> str:
        return MODULES[self.service]

    def argv(self, python: str = sys.executable) -> list[str]:
        return [python, "-m", self.module, *self.args]


def service_names(cfg: MeshConfig, routes: EnvRoutes | None = None) -> list[str]:
    sandbox = ["sandbox"] if uses_code(cfg) else []  # before the reward server, which sends it the code items
    env = ["env"] if uses_envs(cfg, routes) else []
    router = ["router"] if cfg.gateway_port is not None else []  # ready once a replica's gateway is
    return [*sandbox, "reward", *env, "buffer", "learner", *(f"rollout-{i}" for i in range(cfg.replicas)), *router]


def uses_code(cfg: MeshConfig) -> bool:
    """The mesh runs the sandbox service: a file part of the dataset names the code verifier (`file:t.jsonl@code`,
    the reward server sends it the answers' programs), or an environment whose tool runs in it (`env:compute`)."""
    return CODE in file_verifiers(cfg.dataset) or bool(SANDBOXED_ENVS & set(env_names(cfg.dataset)))


def uses_envs(cfg: MeshConfig, routes: EnvRoutes | None = None) -> bool:
    """The dataset has environment tasks (env:<name> parts) that no server of the user's serves: the mesh runs its
    own environment service for them."""
    routed = routes.urls if routes is not None else {}
    return any(name not in routed for name in env_names(cfg.dataset))


def allocate_ports(cfg: MeshConfig, routes: EnvRoutes | None = None) -> dict[str, int]:
    """Free ports for every service's HTTP, the weight sync's rendezvous, the learner's store and each replica's
    gateway (the router's is the preset's gateway_port: the one endpoint agents are told). All picked in this one
    process, so no two are the same: a replica binds its ports minutes later, after its engine loads."""
    names = [n for n in service_names(cfg, routes) if n != "router"] + [SYNC_PORT, DIST_PORT]
    if cfg.gateway_port is not None:
        names += [gateway_of(f"rollout-{i}") for i in range(cfg.replicas)]
    ports = {name: free_port() for name in names}
    return ports | ({"router": cfg.gateway_port} if cfg.gateway_port is not None else {})


def gateway_of(replica: str) -> str:
    """A replica's gateway, in the ports mapping."""
    return f"gateway-{replica}"


def service_commands(
    cfg: MeshConfig, model_dir: Path, redis_url: str, ports: Mapping[str, int], routes: EnvRoutes | None = None
) -> list[ServiceCommand]:
    """Each service's settings (the mesh's values, then its preset section over them) as its command line, and its
    environment: the Redis URL; a replica's, the tokens of the user's environment servers."""
    values = service_values(cfg, model_dir, ports, routes)
    env = {"DAPO_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    tokens = {"DAPO_ENV_ROUTE_TOKENS": json.dumps(routes.tokens)} if routes is not None and routes.tokens else {}
    return [
        ServiceCommand(name, tuple(to_flags(values[name])), env | (tokens if name.startswith("rollout") else {}))
        for name in service_names(cfg, routes)
    ]


def service_values(
    cfg: MeshConfig, model_dir: Path, ports: Mapping[str, int], routes: EnvRoutes | None = None
) -> dict[str, dict[str, Any]]:
    """What each service is started with, by setting name: what the mesh decides (only `MESH_SETS` names, and a
    few defaults a preset may change: workers, seeds, cores), then the preset's section for that service."""
    run = RunLayout(cfg.run_dir)
    broadcast = cfg.transport == "broadcast"
    cores = split_cores() if cfg.placement == "split" else None
    own_envs = uses_envs(cfg, routes)
    sandbox_url = {"sandbox_url": f"http://127.0.0.1:{ports['sandbox']}"} if "sandbox" in ports else {}
    out: dict[str, dict[str, Any]] = {
        "reward": {"port": ports["reward"], "workers": 1} | sandbox_url,
        **({"sandbox": {"port": ports["sandbox"]}} if "sandbox" in ports else {}),
        **({"env": {"port": ports["env"]} | sandbox_url} if own_envs else {}),
        "buffer": {
            "port": ports["buffer"],
            "run_dir": run.buffer,
            "dataset": cfg.dataset,
            "n_samples": cfg.n_samples,
            "batch_size": cfg.batch_size,
            "max_staleness": cfg.max_staleness,
            "shuffle_seed": cfg.seed,
            "record_episodes": 1.0,  # for `dapo-mesh view` (bounded on disk: record_episodes_mb)
        },
        "learner": {
            "port": ports["learner"],
            "model_dir": model_dir,
            "run_dir": run.learner,
            "max_batches": cfg.steps,
            "minibatches": cfg.minibatches,
            "lr": cfg.lr,
            "dtype": cfg.dtype,
            "weight_sync": "broadcast" if broadcast else "none",
            "sync_port": ports[SYNC_PORT],
            "dist_port": ports[DIST_PORT],
            "max_staleness": cfg.max_staleness,
            "hold_after_max": True,
            "ranks": cfg.learner_ranks,
            "max_response_tokens": cfg.max_response_tokens,  # Dr.GRPO's constant divisor
            "lora_rank": cfg.lora_rank,
            "seed": cfg.seed,
            "cpu_cores": cores[0] if cores else None,
            "record_episodes": 1.0,
        },
    }
    for i in range(cfg.replicas):
        name = f"rollout-{i}"
        out[name] = {
            "port": ports[name],
            "engine": cfg.engine,
            "model_dir": model_dir,
            "reward_url": f"http://127.0.0.1:{ports['reward']}",
            **({"env_url": f"http://127.0.0.1:{ports['env']}"} if own_envs else {}),
            **({"env_routes": routes.urls} if routes is not None and routes.urls else {}),
            "weights_dir": run.snapshots,
            "replica_id": name,
            "max_response_tokens": cfg.max_response_tokens,
            "sync_broadcast": broadcast,
            "dtype": cfg.dtype,
            "seed": None if cfg.seed is None else cfg.seed + i,  # replicas must not repeat each other
            "cpu_cores": cores[1] if cores else None,
            "lora_max_rank": cfg.lora_rank,
        }
        if cfg.gateway_port is not None:  # its own port; the router in front is the one endpoint
            port = ports[gateway_of(name)]
            out[name] |= {"gateway_port": port, "gateway_url": f"http://127.0.0.1:{port}"}
        if cfg.eval_every and i == 0:  # rollout-0 evaluates the held-out split the buffer wrote
            out[name] |= {"eval_every": cfg.eval_every, "eval_data": run.eval_items}
            out[name] |= {"eval_size": cfg.eval_size, "eval_tasks": cfg.eval_tasks, "eval_k": cfg.eval_k}
            out[name] |= {"eval_record_samples": min(cfg.eval_size * cfg.eval_k, 1024)}
    if cfg.gateway_port is not None:
        out["router"] = {"port": cfg.gateway_port}
    return {name: v | cfg.section(_service(name)) for name, v in out.items()}


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
