"""`dapo-mesh up`: the whole mesh as local processes — Redis, reward server, buffer, rollout replicas,
learner — wired by a config (mesh/config.py), logs per service under the run directory, stopped
cleanly.

    dapo-mesh up                            # configs/dapo.toml: SmolLM2-135M-Instruct, 1-digit arithmetic, vLLM
    dapo-mesh up --tiny                     # a random tiny Llama, a few steps: a smoke test in a minute

    mesh = Mesh(cfg); mesh.start(); mesh.run(); mesh.stop()

The parts: `service_commands` (what each service runs), `Supervisor` (processes, restarts, Redis),
`RunRecorder` (ledger and evaluations -> metrics.jsonl, curves.png), `LiveView` (what a terminal shows).
Weights reach the replicas by broadcast (gloo on CPU, NCCL on GPU) after every learner step; the learner
also writes an HF snapshot per step (learner/hf) that a late-joining replica starts from
(`transport="filesystem"` makes the snapshot the only transport). `prometheus/` holds the shipped local
config and the services' addresses as file-based targets:
`prometheus --config.file=RUN_DIR/prometheus/prometheus.yml`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mesh.commands import CODE, allocate_ports, service_commands, service_values, uses_code
from mesh.config import MeshConfig, PresetError
from mesh.envs import check_env_servers
from mesh.layout import RunFile, RunLayout
from mesh.live import LiveView, ServiceState, scrape
from mesh.recorder import RunRecorder, line
from mesh.supervisor import Supervisor
from services.child_process import ROOT, wait_ready
from services.dtype import machine
from services.schemas import CLIENT_SCORED
from services.settings import redact
from services.snapshots import write_atomic

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
SCRAPE_EVERY_S = 5.0  # the live view's refresh of health and metrics (and at every new learner step)
JOBS = {
    "reward": "reward-server",
    "env": "env-server",
    "buffer": "buffer",
    "learner": "learner",
    "rollout": "rollout",
    "router": "router",
    "sandbox": "sandbox",
}


class Mesh:
    def __init__(
        self, cfg: MeshConfig, say: Callable[[str], None] = print, console: Any = None, preset: str | None = None
    ):
        self.cfg, self.say, self.console = cfg, say, console  # a rich Console on a terminal: the live view
        self.preset = preset  # the preset file the config came from (None: the tiny mesh's, or made in code)
        self.paths = RunLayout(cfg.run_dir)
        self.sup = Supervisor(self.paths, max_restarts=cfg.max_restarts, say=say)
        self.recorder = RunRecorder(
            self.paths,
            client=self.client,
            say=say,
            table_every=cfg.tracking.table_every,
            table_rows=cfg.tracking.table_rows,
        )
        self.ports: dict[str, int] = {}
        self.url = ""
        self._client: Any = None  # the mesh's own Redis connection (see client())
        self.started, self._cpu0 = time.monotonic(), time.process_time()

    def model_dir(self) -> Path:
        if self.cfg.tiny:
            from learner.tiny import tiny_llama

            path = self.paths.tiny_model
            return path if (path / "config.json").exists() else tiny_llama(path, hidden=256, tokenizer=True)
        from services.model_prep import prepare_smollm2

        return prepare_smollm2(self.paths.smollm2)

    def start(self) -> None:
        """Redis, then every service; returns once each answers /readyz. Everything that can be checked before a
        service starts is checked first (the data, the environment servers, LoRA): a PresetError in one line."""
        routes = check_env_servers(self.cfg)  # before the model: a wrong URL or token is said at once
        for url, names in routes.served.items():
            self.say(f"env server {url}: {', '.join(names)}")
        model = self.model_dir()
        self.say(f"model: {model}")
        self.ports = allocate_ports(self.cfg, routes)
        self.check_data(service_values(self.cfg, model, self.ports, routes)["buffer"])
        self.check_lora(model)
        self.write_config()
        self.open_trackers()
        self.started, self._cpu0 = time.monotonic(), time.process_time()  # the run's CPU, not the model's set-up
        self.url = self.cfg.redis_url or self.sup.start_redis()
        self.say(f"redis: {self.url}")
        servers = [s.model_dump() | {"envs": routes.served.get(s.url, [])} for s in self.cfg.env_servers]
        RunFile(None if self.cfg.redis_url else self.url, servers).write(self.paths)
        for cmd in service_commands(self.cfg, model, self.url, self.ports, routes):
            self.sup.spawn(cmd)
        self.write_prometheus_targets()
        for name, proc in self.sup.procs.items():
            wait_ready(
                proc,
                f"http://127.0.0.1:{self.ports[name]}/readyz",
                name=name,
                timeout_s=600,
                log_hint=f"; see {self.paths.log(name)}",
            )
            self.say(f"ready: {name} (http://127.0.0.1:{self.ports[name]})")

    def write_config(self) -> dict[str, Any]:
        """config.json: the preset's path and the resolved config (`dapo-mesh compare` tells runs apart by it); no
        Redis URL (it may hold a password)."""
        data = {"preset": self.preset, "config": self.params()}
        self.paths.root.mkdir(parents=True, exist_ok=True)
        write_atomic(self.paths.config, json.dumps(data, indent=1))
        return data

    def params(self) -> dict[str, Any]:
        """The resolved config as JSON: no Redis URL, URL passwords (an MLflow server's, an environment server's) as
        stars, secrets as stars."""
        return dict(redact(self.cfg.model_dump(mode="json", exclude={"redis_url"})))

    def open_trackers(self) -> None:
        """The preset's trackers, before any service starts: one that cannot open is a PresetError now."""
        if not self.cfg.trackers:
            return
        from mesh.trackers import TrackerError, open_trackers

        params = {"preset": self.preset, **{k: v for k, v in self.params().items() if k != "run_dir"}}
        try:
            self.recorder.trackers = open_trackers(
                list(self.cfg.trackers), self.cfg.tracking, self.paths.root, params, say=self.say
            )
        except TrackerError as e:
            raise PresetError(f"trackers: {e}") from None

    def check_data(self, buffer_values: dict[str, Any]) -> None:
        """Read the dataset as the buffer will, before anything starts: a file row without a verifier, a part or task
        whose held-out share would be empty, is an error now, not a buffer that fails to start."""
        from buffer.runner import buffer_source
        from buffer.settings import BufferSettings

        try:
            given = {k: v for k, v in buffer_values.items() if v is not None}  # None: the setting's default (to_flags)
            source = buffer_source(BufferSettings.model_validate(given))
        except (ValueError, OSError) as e:
            raise PresetError(f"dataset {self.cfg.dataset!r}: {e}") from None
        self.say(f"dataset: {source.name}, {len(source.train)} training prompts, {len(source.eval)} held out")
        if any(it.verifier == CODE for it in [*source.train, *source.eval]) and not uses_code(self.cfg):
            raise PresetError(
                f'dataset {self.cfg.dataset!r}: its rows say verifier "{CODE}": name it on the file part '
                f"(file:PATH@{CODE}) so that the mesh starts the sandbox service the code verifier runs programs in"
            )
        if any(it.verifier == CLIENT_SCORED for it in source.train):
            if self.cfg.gateway_port is None or not self.cfg.rollout.gateway_only:
                raise PresetError(
                    f'dataset {self.cfg.dataset!r}: its rows say verifier "{CLIENT_SCORED}" (the client of a gateway '
                    "session scores them): serve them through the gateway only ([mesh] gateway_port, [rollout] "
                    "gateway_only = true)"
                )
            if self.cfg.eval_every:
                raise PresetError(
                    f'dataset {self.cfg.dataset!r}: verifier "{CLIENT_SCORED}" rows have no scorer in the mesh for a '
                    "held-out evaluation: set eval_every = 0"
                )

    def check_lora(self, model: Path) -> None:
        """LoRA: the replicas' vLLM serves adapters of this rank on this model and these targets, before anything
        starts (the learner checks the targets against the model itself when it loads it)."""
        if self.cfg.lora_rank is None:
            return
        from rollout.engines.lora import check_servable, resolve_serving, served_dtype
        from services.dtype import resolve_dtype

        try:
            check_servable(model, self.cfg.lora_rank, self.cfg.learner.lora_target_list, self.cfg.rollout.lora_serving)
            served_dtype(resolve_serving(self.cfg.rollout.lora_serving), resolve_dtype(self.cfg.dtype), self.cfg.dtype)
        except ValueError as e:
            raise PresetError(f"lora_rank {self.cfg.lora_rank}: {e}") from None
        self.say(f"lora: rank {self.cfg.lora_rank} on {', '.join(self.cfg.learner.lora_target_list)}")

    def write_prometheus_targets(self) -> Path:
        """RUN_DIR/prometheus: the shipped local config and rules, and this mesh's services as targets."""
        out = self.paths.prometheus
        (out / "targets").mkdir(parents=True, exist_ok=True)
        shutil.copy(PROMETHEUS_DIR / "local.yml", out / "prometheus.yml")
        shutil.copy(PROMETHEUS_DIR / "rules.yml", out / "rules.yml")
        groups = [
            {"targets": [f"127.0.0.1:{self.ports[name]}"], "labels": {"job": JOBS[cmd.service], "service": name}}
            for name, cmd in self.sup.cmds.items()
        ]
        tmp = out / "targets" / ".mesh.json.tmp"
        tmp.write_text(json.dumps(groups, indent=1))
        tmp.replace(out / "targets" / "mesh.json")
        return out

    def scrape(self) -> list[ServiceState]:
        states = [scrape(name, self.ports[name], self.sup.alive(name)) for name in self.sup.procs]
        for st in states:
            st.restarts = self.sup.restarts.get(st.name, 0)
        return states

    def tick(self) -> None:
        """Once a second: the restart policy and the held-out evaluations."""
        self.sup.supervise()
        if self.cfg.eval_every:
            self.recorder.record_evals()

    def run(self) -> int:
        """Until the learner has trained `steps` batches and every replica holds them; then `linger_s` more."""
        view = LiveView(self.cfg.steps)
        states: list[ServiceState] = []
        next_scrape = 0.0
        live: Any = contextlib.nullcontext()
        if self.console is not None:
            from rich.live import Live

            live = Live(view.render(), console=self.console, refresh_per_second=2, transient=False)
        with live as screen:
            while self.recorder.version < self.cfg.steps:
                self.tick()
                entries = self.recorder.new_entries()
                if entries or time.monotonic() >= next_scrape:  # scraping costs CPU the mesh needs
                    states, next_scrape = self.scrape(), time.monotonic() + SCRAPE_EVERY_S
                rows = self.recorder.record_steps(entries, states)
                if screen is None:
                    for r in rows:
                        self.say(line(r, self.cfg.steps))
                view.update(states, rows[-1] if rows else None, self.recorder.version)
                if screen is not None:
                    screen.update(view.render())
                time.sleep(1)
            self.wait_replicas_synced()
            if self.cfg.eval_every and self.cfg.steps % self.cfg.eval_every == 0:
                self.wait_final_eval()
            deadline = time.monotonic() + self.cfg.linger_s
            while time.monotonic() < deadline:  # for a last look (Prometheus, Grafana, the live view)
                view.update(self.scrape(), None, self.recorder.version)
                if screen is not None:
                    screen.update(view.render())
                time.sleep(1)
        return 0

    def client(self) -> Any:
        """A Redis connection of the mesh's own (reading eval results, replica heartbeats), made once."""
        from services.streams import connect

        if self._client is None:
            self._client = connect(self.url)
        return self._client

    def wait_final_eval(self, timeout_s: float = 3600) -> None:
        deadline = time.monotonic() + timeout_s
        while self.cfg.steps not in self.recorder.evaluated and time.monotonic() < deadline:
            self.tick()
            time.sleep(1)
        if self.cfg.steps not in self.recorder.evaluated:
            self.say(f"[yellow]no held-out evaluation of version {self.cfg.steps} within {timeout_s:.0f} s[/]")

    def wait_replicas_synced(self, timeout_s: float = 60) -> None:
        """The run ends with every replica holding the final weights (they load them between calls)."""
        from services.schemas import ReplicaHeartbeat
        from services.streams import KEY_POLICY_VERSION, REPLICA_KEY_PREFIX, unpack

        client = self.client()
        final = int(client.get(KEY_POLICY_VERSION) or 0)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            beats = [client.get(REPLICA_KEY_PREFIX + f"rollout-{i}") for i in range(self.cfg.replicas)]
            versions = [unpack(b, ReplicaHeartbeat).weight_version if b else -1 for b in beats]
            if min(versions) >= final:
                self.say(f"replicas hold the final weights (version {final})")
                return
            time.sleep(0.5)
        self.say(f"[yellow]not every replica loaded version {final} within {timeout_s:.0f} s[/]")

    def stop(self) -> None:
        """The CPU account and the curves (when services ran), then every process stopped, whatever they raise."""
        try:
            if self.sup.procs:
                self.account_cpu()
            if self.recorder.draw():
                self.say(f"curves in {self.paths.curves}")
        finally:
            if self.recorder.trackers is not None:
                self.recorder.trackers.close()  # never raises (mesh/trackers.py)
            if self._client is not None:
                self._client.close()
            self.sup.stop()

    def account_cpu(self) -> dict[str, Any]:
        """cpu.json: CPU seconds of every service and of this orchestrator (live view, scrapes, recorder), the
        orchestrator's share of the run's CPU (goal: under 1%), and the machine the times were measured on."""
        services = self.sup.cpu_seconds()
        mine = time.process_time() - self._cpu0
        total = mine + sum(services.values())
        share = mine / total if total else 0.0
        report = {
            "wall_s": time.monotonic() - self.started,
            "orchestrator_s": mine,
            "services_s": services,
            "orchestrator_share": share,
            "machine": machine(),
        }
        self.paths.cpu.write_text(json.dumps(report, indent=1))
        self.say(
            f"CPU: orchestrator {mine:.1f} s = {100 * share:.2f}% of the run's "
            f"{total:.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in services.items()) + ")"
        )
        return report
