"""`dapo-mesh up`: the whole mesh as local processes — Redis, reward server, buffer, rollout
replicas, learner — wired by settings, logs per service under the run directory, stopped cleanly.

    dapo-mesh up --steps 20                 # SmolLM2-135M-Instruct, reasoning-gym chain_sum, vLLM
    dapo-mesh up --tiny                     # a random tiny Llama, a few steps: a smoke test in a minute

Weights reach the replicas through the filesystem transport: the learner writes an HF export after
every batch (run_dir/learner/hf) and each replica loads the newest between engine calls.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.common.launch import ROOT, wait_ready
from services.common.redis_server import EmbeddedRedis, die_with_parent, free_port


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
    extra: dict[str, list[str]] = field(default_factory=dict)  # more flags per service

    @classmethod
    def tiny_preset(cls, run_dir: Path, steps: int = 3) -> MeshConfig:
        return cls(run_dir=run_dir, steps=steps, tiny=True, engine="hf", n_samples=4, batch_size=4,
                   max_response_tokens=24, minibatches=2, lr=1e-4,
                   extra={"buffer": ["--no-dynamic-sampling"]})  # a random model gets nothing right  # fmt: skip


class Mesh:
    def __init__(self, cfg: MeshConfig, say: Callable[[str], None] = print):
        self.cfg, self.say = cfg, say
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}
        self.redis: EmbeddedRedis | None = None
        self.url = ""
        self.logs = cfg.run_dir / "logs"

    def model_dir(self) -> Path:
        if self.cfg.tiny:
            from learner.tiny import tiny_llama

            path = self.cfg.run_dir / "models" / "tiny-llama"
            return path if (path / "config.json").exists() else tiny_llama(path, hidden=256, tokenizer=True)
        from services.common.models import prepare_smollm2

        return prepare_smollm2(self.cfg.run_dir / "models" / "smollm2-135m-instruct")

    def _start(self, name: str, module: str, args: list[str], url: str) -> None:
        port = self.ports[name] = free_port()
        env = os.environ | {"PYTHONPATH": str(ROOT), "DAPO_REDIS_URL": url, "OMP_NUM_THREADS": "1"}
        log = (self.logs / f"{name}.log").open("ab")
        cmd = [sys.executable, "-m", module, "--port", str(port), *args, *self.cfg.extra.get(name.split("-")[0], [])]
        self.procs[name] = subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )

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
            self.redis = EmbeddedRedis(c.run_dir / "redis", tied_to_thread=True)  # started from the main thread
            url = self.redis.start()
        self.url = url
        self.say(f"redis: {url}")
        learner_dir = c.run_dir / "learner"
        self._start("reward", "reward_server", ["--workers", "1"], url)
        self._start("buffer", "services.buffer", [
            "--run-dir", str(c.run_dir / "buffer"), "--dataset", c.dataset, "--n-samples", str(c.n_samples),
            "--batch-size", str(c.batch_size),
        ], url)  # fmt: skip
        self._start("learner", "learner", [
            "--model-dir", str(model), "--run-dir", str(learner_dir), "--max-batches", str(c.steps),
            "--minibatches", str(c.minibatches), "--lr", str(c.lr), "--micro-batch-size", "4",
        ], url)  # fmt: skip
        for i in range(c.replicas):
            self._start(f"rollout-{i}", "rollout", [
                "--engine", c.engine, "--model-dir", str(model), "--reward-url",
                f"http://127.0.0.1:{self.ports['reward']}", "--weights-dir", str(learner_dir / "hf"),
                "--replica-id", f"rollout-{i}", "--max-response-tokens", str(c.max_response_tokens),
            ], url)  # fmt: skip
        for name in self.procs:
            self._wait_ready(name)
            self.say(f"ready: {name} (http://127.0.0.1:{self.ports[name]})")

    def run(self) -> int:
        """Until the learner has trained `steps` batches; returns the learner's exit code."""
        ledger = self.cfg.run_dir / "learner" / "trained.jsonl"
        seen = 0
        while (code := self.procs["learner"].poll()) is None:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with code {proc.returncode}; see {self.logs / name}.log")
            lines = ledger.read_text().splitlines() if ledger.exists() else []
            for line in lines[seen:]:
                m = json.loads(line)
                self.say(f"step {m['version']}/{self.cfg.steps}: reward {m['reward_mean']:+.3f}  "
                         f"loss {m.get('loss', 0.0):+.4f}  entropy {m['entropy']:.3f}  "
                         f"clip {m.get('clip_frac_upper', 0.0):.3f}  {m['seconds']:.1f} s")  # fmt: skip
                with (self.cfg.run_dir / "metrics.jsonl").open("a") as f:
                    f.write(line + "\n")
            seen = len(lines)
            time.sleep(1)
        if code == 0:
            self.wait_replicas_synced()
        return code

    def wait_replicas_synced(self, timeout_s: float = 60) -> None:
        """The run ends with every replica holding the final weights (they load them between calls)."""
        from services.common.schemas import ReplicaHeartbeat
        from services.common.streams import KEY_POLICY_VERSION, REPLICA_KEY_PREFIX, connect, unpack

        client = connect(self.url)
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
        if self.redis:
            self.redis.stop()
