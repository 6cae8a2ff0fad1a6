"""`dapo-mesh up`: the whole mesh as local processes — Redis, reward server, buffer, rollout
replicas, learner — wired by settings, logs per service under the run directory, stopped cleanly.

    dapo-mesh up --steps 20                 # SmolLM2-135M-Instruct, reasoning-gym chain_sum, vLLM
    dapo-mesh up --tiny                     # a random tiny Llama, a few steps: a smoke test in a minute

Weights reach the replicas by broadcast (gloo on CPU, NCCL on GPU) after every learner step; the
learner also writes an HF snapshot per step (run_dir/learner/hf) that a late-joining replica starts
from (`transport="filesystem"` makes the snapshot the only transport).

While it runs: a live view (rich) of every service's health and metrics, `metrics.jsonl` (one line
per learner step), `curves.png`, and `prometheus/` (the shipped local config + the services'
addresses as file-based targets: `prometheus --config.file=RUN_DIR/prometheus/prometheus.yml`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services import curves
from services.common.launch import ROOT, child_env, wait_ready
from services.common.redis_server import EmbeddedRedis, die_with_parent, free_port
from services.live import LiveView, ServiceState, mesh_numbers, scrape

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
DEFAULT_PRESET = ROOT / "configs" / "dapo.toml"  # what `dapo-mesh up` runs without --config
RESTART_BACKOFF_S, RESTART_BACKOFF_MAX_S = 1.0, 30.0  # 1, 2, 4, ... s before restarting a service again
SCRAPE_EVERY_S = 5.0  # the live view's refresh of health and metrics (and at every new learner step)
JOBS = {"reward": "reward-server", "buffer": "buffer", "learner": "learner", "rollout": "rollout"}


@dataclass
class MeshConfig:
    run_dir: Path = Path(".dapo")
    steps: int = 20
    tiny: bool = False
    redis_url: str | None = None
    replicas: int = 1
    engine: str = "vllm"
    n_samples: int = 8
    batch_size: int = 8
    max_response_tokens: int = 128
    minibatches: int = 4
    lr: float = 1e-6
    dataset: str = "reasoning_gym:chain_sum"
    transport: str = "broadcast"  # or "filesystem": replicas reload the learner's HF snapshots
    eval_every: int = 0  # held-out avg@k by rollout-0 at version 0 and every n versions (0: off)
    eval_size: int = 64  # held-out prompts per evaluation
    eval_k: int = 4  # samples per held-out prompt
    linger_s: float = 0.0  # keep the mesh up this long after the last step
    max_restarts: int = 10  # per service; 0: the first exit stops the mesh
    extra: dict[str, list[str]] = field(default_factory=dict)  # more flags per service

    @classmethod
    def from_preset(cls, path: Path, **overrides: Any) -> MeshConfig:
        """A preset file (services/presets.py): its [mesh] section, and its service sections as extra flags."""
        from dataclasses import fields

        from services.presets import load_preset

        names = {f.name for f in fields(cls)} - {"run_dir", "extra", "redis_url"}
        preset = load_preset(path, names)
        extra = {name: preset.flags(name) for name in preset.services if preset.services[name]}
        return cls(**(preset.mesh | overrides), extra=extra)

    @classmethod
    def tiny_preset(cls, run_dir: Path, steps: int = 3) -> MeshConfig:
        return cls(run_dir=run_dir, steps=steps, tiny=True, engine="hf", n_samples=4, batch_size=4,
                   max_response_tokens=24, minibatches=2, lr=1e-4, eval_size=16, eval_k=2,
                   extra={"buffer": ["--no-dynamic-sampling"]})  # a random model gets nothing right  # fmt: skip


class Mesh:
    def __init__(self, cfg: MeshConfig, say: Callable[[str], None] = print, console: Any = None):
        self.cfg, self.say, self.console = cfg, say, console  # a rich Console on a terminal: the live view
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.cmds: dict[str, tuple[list[str], dict[str, str]]] = {}
        self.restarts: dict[str, int] = {}
        self.down_since: dict[str, float] = {}
        self.ports: dict[str, int] = {}
        self.redis: EmbeddedRedis | None = None
        self.url = ""
        self.logs = cfg.run_dir / "logs"
        self._client: Any = None  # the mesh's own Redis connection (see client())
        self._eval_seen = ""  # the last dapo:eval entry recorded
        self.evaluated: set[int] = set()  # policy versions with a held-out evaluation

    def model_dir(self) -> Path:
        if self.cfg.tiny:
            from learner.tiny import tiny_llama

            path = self.cfg.run_dir / "models" / "tiny-llama"
            return path if (path / "config.json").exists() else tiny_llama(path, hidden=256, tokenizer=True)
        from services.common.models import prepare_smollm2

        return prepare_smollm2(self.cfg.run_dir / "models" / "smollm2-135m-instruct")

    def _start(self, name: str, module: str, args: list[str], url: str) -> None:
        port = self.ports[name] = free_port()
        env = child_env(DAPO_REDIS_URL=url, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", module, "--port", str(port), *args, *self.cfg.extra.get(name.split("-")[0], [])]
        self.cmds[name] = (cmd, env)
        self._spawn(name)

    def _spawn(self, name: str) -> None:
        cmd, env = self.cmds[name]
        with (self.logs / f"{name}.log").open("ab") as log:
            self.procs[name] = subprocess.Popen(
                cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
            )
        self._write_pids()

    def _write_pids(self) -> None:
        pids = {name: p.pid for name, p in self.procs.items()}
        if self.redis is not None and self.redis.proc is not None:
            pids["redis"] = self.redis.proc.pid
        tmp = self.cfg.run_dir / ".pids.json.tmp"
        tmp.write_text(json.dumps(pids))
        tmp.replace(self.cfg.run_dir / "pids.json")

    def supervise(self) -> None:
        """The restart policy (like a container's `restart: on-failure`): a service that exits while the mesh
        runs is started again with the same command, port and consumer name, after a backoff; so is the
        embedded Redis (same port, same append-only file). Each restart is a line in supervisor.jsonl."""
        now = time.monotonic()
        dead = [(n, p.returncode) for n, p in self.procs.items() if p.poll() is not None]
        if self.redis is not None and self.redis.proc is not None and self.redis.proc.poll() is not None:
            dead.insert(0, ("redis", self.redis.proc.returncode))
        for name, code in dead:
            if name not in self.down_since:
                self.down_since[name] = now
                self.say(f"[yellow]{name} exited with code {code}[/]")
            n = self.restarts.get(name, 0)
            if n >= self.cfg.max_restarts:
                raise RuntimeError(f"{name} exited {n + 1} times (code {code}); see {self.logs / name}.log")
            if now - self.down_since[name] < min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2**n):
                continue
            if name == "redis":
                assert self.redis is not None
                self.redis.start()  # the same port and data dir: the streams come back from the AOF
                self._write_pids()
            else:
                self._spawn(name)
            self.restarts[name] = n + 1
            del self.down_since[name]
            with (self.cfg.run_dir / "supervisor.jsonl").open("a") as f:
                f.write(json.dumps({"time": time.time(), "service": name, "exit_code": code, "restart": n + 1}) + "\n")
            self.say(f"restarted {name} (restart {n + 1})")

    def _wait_ready(self, name: str, timeout_s: float = 600) -> None:
        url = f"http://127.0.0.1:{self.ports[name]}/readyz"
        wait_ready(self.procs[name], url, name=name, timeout_s=timeout_s, log_hint=f"; see {self.logs / name}.log")

    def start(self) -> None:
        c = self.cfg
        self.logs.mkdir(parents=True, exist_ok=True)
        model = self.model_dir()
        self.say(f"model: {model}")
        if c.redis_url:
            url = c.redis_url
        else:
            # started from the main thread (see tied_to_thread); fsync on every write: a killed Redis loses nothing
            # it acknowledged, so the exactly-once bookkeeping of the buffer and learner survives it
            self.redis = EmbeddedRedis(c.run_dir / "redis", tied_to_thread=True, appendfsync="always")
            url = self.redis.start()
        self.url = url
        self.say(f"redis: {url}")
        learner_dir = c.run_dir / "learner"
        self._start("reward", "reward_server", ["--workers", "1"], url)
        self._start("buffer", "services.buffer", [
            "--run-dir", str(c.run_dir / "buffer"), "--dataset", c.dataset, "--n-samples", str(c.n_samples),
            "--batch-size", str(c.batch_size),
        ], url)  # fmt: skip
        broadcast = c.transport == "broadcast"
        self._start("learner", "learner", [
            "--model-dir", str(model), "--run-dir", str(learner_dir), "--max-batches", str(c.steps),
            "--minibatches", str(c.minibatches), "--lr", str(c.lr), "--micro-batch-size", "4",
            "--weight-sync", "broadcast" if broadcast else "none", "--sync-port", str(free_port()), "--hold-after-max",
        ], url)  # fmt: skip
        for i in range(c.replicas):
            evaluator = []  # rollout-0 evaluates the held-out split the buffer wrote
            if c.eval_every and i == 0:
                evaluator = ["--eval-every", str(c.eval_every), "--eval-data", str(c.run_dir / "buffer" / "eval.jsonl"),
                             "--eval-size", str(c.eval_size), "--eval-k", str(c.eval_k)]  # fmt: skip
            self._start(f"rollout-{i}", "rollout", [
                "--engine", c.engine, "--model-dir", str(model), "--reward-url",
                f"http://127.0.0.1:{self.ports['reward']}", "--weights-dir", str(learner_dir / "hf"),
                "--replica-id", f"rollout-{i}", "--max-response-tokens", str(c.max_response_tokens),
                "--sync-broadcast" if broadcast else "--no-sync-broadcast", *evaluator,
            ], url)  # fmt: skip
        self.write_prometheus_targets()
        for name in self.procs:
            self._wait_ready(name)
            self.say(f"ready: {name} (http://127.0.0.1:{self.ports[name]})")

    def write_prometheus_targets(self) -> Path:
        """RUN_DIR/prometheus: the shipped local config and rules, and this mesh's services as targets."""
        out = self.cfg.run_dir / "prometheus"
        (out / "targets").mkdir(parents=True, exist_ok=True)
        shutil.copy(PROMETHEUS_DIR / "local.yml", out / "prometheus.yml")
        shutil.copy(PROMETHEUS_DIR / "rules.yml", out / "rules.yml")
        groups = [{"targets": [f"127.0.0.1:{port}"], "labels": {"job": JOBS[name.split("-")[0]], "service": name}}
                  for name, port in self.ports.items()]  # fmt: skip
        tmp = out / "targets" / ".mesh.json.tmp"
        tmp.write_text(json.dumps(groups, indent=1))
        tmp.replace(out / "targets" / "mesh.json")
        return out

    def scrape(self) -> list[ServiceState]:
        states = [scrape(name, self.ports[name], proc.poll() is None) for name, proc in self.procs.items()]
        for st in states:
            st.restarts = self.restarts.get(st.name, 0)
        return states

    def run(self) -> int:
        """Until the learner has trained `steps` batches and every replica holds them; then `linger_s` more."""
        ledger = self.cfg.run_dir / "learner" / "trained.jsonl"
        metrics = self.cfg.run_dir / "metrics.jsonl"
        view = LiveView(self.cfg.steps)
        read = 0  # ledger lines read
        version = 0  # the newest policy version in metrics.jsonl
        states: list[ServiceState] = []
        next_scrape = 0.0
        live: Any = contextlib.nullcontext()
        if self.console is not None:
            from rich.live import Live

            live = Live(view.render(), console=self.console, refresh_per_second=2, transient=False)
        with live as screen:
            while version < self.cfg.steps:
                self.supervise()
                self.record_evals(metrics)
                lines = ledger.read_text().splitlines() if ledger.exists() else []
                if len(lines) > read or time.monotonic() >= next_scrape:  # scraping costs CPU the mesh needs
                    states, next_scrape = self.scrape(), time.monotonic() + SCRAPE_EVERY_S
                rows = []
                for line in lines[read:]:
                    m = json.loads(line)
                    if m["version"] > version:  # a version trained again after a learner crash: logged once
                        version = m["version"]
                        rows.append(self.row(version, m, states))
                read = len(lines)
                if rows:
                    self.append_rows(metrics, rows)
                    if screen is None:
                        for r in rows:
                            self.say(self.line(r))
                view.update(states, rows[-1] if rows else None, version)
                if screen is not None:
                    screen.update(view.render())
                time.sleep(1)
            self.wait_replicas_synced()
            if self.cfg.eval_every and self.cfg.steps % self.cfg.eval_every == 0:
                self.wait_final_eval(metrics)
            deadline = time.monotonic() + self.cfg.linger_s
            while time.monotonic() < deadline:  # for a last look (Prometheus, Grafana, the live view)
                view.update(self.scrape(), None, version)
                if screen is not None:
                    screen.update(view.render())
                time.sleep(1)
        return 0

    def client(self) -> Any:
        """A Redis connection of the mesh's own (reading eval results, replica heartbeats), made once."""
        from services.common.streams import connect

        if self._client is None:
            self._client = connect(self.url)
        return self._client

    def append_rows(self, metrics: Path, rows: list[dict[str, Any]]) -> None:
        """Rows to metrics.jsonl, and curves.png redrawn from it."""
        with metrics.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        curves.plot(metrics, self.cfg.run_dir / "curves.png")

    def record_evals(self, metrics: Path) -> None:
        """New held-out evaluations (dapo:eval) -> rows of metrics.jsonl with kind "eval"."""
        import redis

        from services.common.schemas import EvalResult
        from services.common.streams import STREAM_EVAL, RedisUnavailable, decode

        if not self.cfg.eval_every:
            return
        try:
            entries = self.client().xrange(STREAM_EVAL, min=f"({self._eval_seen}" if self._eval_seen else "-")
        except (RedisUnavailable, redis.RedisError, OSError) as err:  # Redis restarting: the next pass reads them
            self.say(f"[yellow]could not read {STREAM_EVAL}: {err}[/]")
            return
        rows: list[dict[str, Any]] = []
        for entry_id, fields in entries:  # type: ignore[union-attr]
            self._eval_seen = entry_id.decode()
            e = decode(fields, EvalResult)
            rows.append({"kind": "eval", "step": e.version, "policy_version": e.version, "eval_acc": e.avg_at_k,
                         "eval_pass_at_k": e.pass_at_k, "eval_k": e.k, "eval_prompts": e.n_prompts,
                         "eval_response_tokens": e.mean_response_tokens, "eval_seconds": e.seconds})  # fmt: skip
            self.say(f"held-out eval of version {e.version}: avg@{e.k} {e.avg_at_k:.3f}  pass@{e.k} "
                     f"{e.pass_at_k:.3f}  ({e.n_prompts} prompts, {e.seconds:.0f} s)")  # fmt: skip
        if rows:
            self.append_rows(metrics, rows)
            self.evaluated.update(r["policy_version"] for r in rows)

    def wait_final_eval(self, metrics: Path, timeout_s: float = 3600) -> None:
        deadline = time.monotonic() + timeout_s
        while self.cfg.steps not in self.evaluated and time.monotonic() < deadline:
            self.supervise()
            self.record_evals(metrics)
            time.sleep(1)
        if self.cfg.steps not in self.evaluated:
            self.say(f"[yellow]no held-out evaluation of version {self.cfg.steps} within {timeout_s:.0f} s[/]")

    @staticmethod
    def row(step: int, m: dict[str, Any], states: list[ServiceState]) -> dict[str, Any]:
        """One line of metrics.jsonl: the learner's step, and the mesh's numbers at that moment."""
        m = dict(m)
        version = m.pop("version")
        m.pop("pid", None)
        m.pop("task_ids", None)
        mesh = {k: v for k, v in mesh_numbers(states).items() if v == v}  # NaN: not known yet
        return {"kind": "train", "step": step, "policy_version": version, **m, **mesh}

    def line(self, r: dict[str, Any]) -> str:
        return (f"step {r['step']}/{self.cfg.steps} (version {r['policy_version']}): reward {r['reward_mean']:+.3f}  "
                f"acc {r['acc_mean']:.3f}  entropy {r['entropy']:.3f}  clip {r.get('clip_frac_upper', 0.0):.3f}  "
                f"filtered {r.get('filtered_frac', float('nan')):.0%}  {r['seconds']:.1f} s")  # fmt: skip

    def wait_replicas_synced(self, timeout_s: float = 60) -> None:
        """The run ends with every replica holding the final weights (they load them between calls)."""
        from services.common.schemas import ReplicaHeartbeat
        from services.common.streams import KEY_POLICY_VERSION, REPLICA_KEY_PREFIX, unpack

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
        for proc in reversed(self.procs.values()):  # replicas first, the reward server last
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for proc in self.procs.values():
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if self._client is not None:
            self._client.close()
        if self.redis:
            self.redis.stop()
