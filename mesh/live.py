"""What `dapo-mesh up` shows while it runs: each service's health and metrics, scraped from its own
/readyz and /metrics (the same numbers Prometheus sees), and the learner's last step.

    states = [scrape(name, port, alive) for ...]     # every few seconds (Mesh.scrape)
    view = LiveView(steps=20)
    view.update(states, last_row, steps_done)        # last_row: the newest row of metrics.jsonl
    with Live(view.render(), console=console): ...   # rich, on a terminal
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

Samples = dict[str, list[tuple[dict[str, str], float]]]  # metric sample name -> [(labels, value)]


@dataclass
class ServiceState:
    name: str
    port: int
    alive: bool
    ready: bool = False
    detail: str = ""
    metrics: Samples = field(default_factory=dict)
    restarts: int = 0  # by the mesh's supervisor


_http: httpx.Client | None = None


def http() -> httpx.Client:
    """The scrapes' one HTTP client, kept alive: a bare `httpx.get` builds an SSL context each time (~30 ms of CPU
    measured; 8 of them per 5-s scrape were most of the orchestrator's 4.4% of a 2-core run)."""
    global _http
    if _http is None:
        _http = httpx.Client()
    return _http


def scrape(name: str, port: int, alive: bool, timeout_s: float = 1.0) -> ServiceState:
    st = ServiceState(name, port, alive)
    if not alive:
        st.detail = "exited"
        return st
    base = f"http://127.0.0.1:{port}"
    try:
        r = http().get(f"{base}/readyz", timeout=timeout_s)
        st.ready = r.status_code == 200
        if r.headers.get("content-type", "").startswith("application/json"):
            st.detail = str(r.json().get("detail", ""))
        text = http().get(f"{base}/metrics", timeout=timeout_s).text
    except (httpx.HTTPError, ValueError) as e:
        st.detail = f"unreachable: {type(e).__name__}"
        return st
    samples: Samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[s.name].append((dict(s.labels), float(s.value)))
    st.metrics = dict(samples)
    return st


def value(states: list[ServiceState], name: str, *, prefix: str = "", how: str = "sum", **labels: str) -> float:
    """One number from every service whose name starts with `prefix`: sum, max or mean of the samples."""
    vals = [
        v
        for st in states
        if st.name.startswith(prefix)
        for lab, v in st.metrics.get(name, [])
        if all(lab.get(k) == x for k, x in labels.items())
    ]
    if not vals:
        return math.nan
    return {"sum": sum(vals), "max": max(vals), "min": min(vals), "mean": sum(vals) / len(vals)}[how]


def mesh_numbers(states: list[ServiceState]) -> dict[str, float]:
    """The mesh-wide numbers the live view and metrics.jsonl carry."""
    received = value(states, "dapo_buffer_groups_received_total", prefix="buffer")
    kept = value(states, "dapo_buffer_groups_kept_total", prefix="buffer")
    lag_sum = value(states, "dapo_buffer_version_lag_sum", prefix="buffer")
    lag_n = value(states, "dapo_buffer_version_lag_count", prefix="buffer")
    sync_sum = value(states, "dapo_learner_sync_seconds_sum", prefix="learner")
    sync_n = value(states, "dapo_learner_sync_seconds_count", prefix="learner")
    serve_sum = value(states, "dapo_rollout_weight_serve_seconds_sum", prefix="rollout")
    serve_n = value(states, "dapo_rollout_weight_serve_seconds_count", prefix="rollout")
    samples = value(states, "dapo_rollout_samples_total", prefix="rollout")
    return {
        "groups_received": received,
        "filtered_frac": 1 - kept / received if received > 0 else math.nan,  # NaN > 0 is False
        "version_lag_mean": lag_sum / lag_n if lag_n else math.nan,
        "rollout_tokens_per_s": value(states, "dapo_rollout_tokens_per_second", prefix="rollout"),
        "replica_version_min": value(states, "dapo_rollout_weight_version", prefix="rollout", how="min"),
        "sync_seconds_mean": sync_sum / sync_n if sync_n else math.nan,
        "rollout_idle_frac": value(states, "dapo_rollout_idle_fraction", prefix="rollout", how="mean"),
        "weight_serve_seconds_mean": serve_sum / serve_n if serve_n else math.nan,
        "multi_version_frac": value(states, "dapo_rollout_multi_version_samples_total", prefix="rollout") / samples
        if samples
        else math.nan,
        "reward_items": value(states, "dapo_reward_items_total", prefix="reward"),
    }


def _fmt(x: Any, spec: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


class LiveView:
    def __init__(self, steps: int):
        self.progress = Progress(
            TextColumn("[bold]learner steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
        )
        self.task = self.progress.add_task("steps", total=steps)
        self.states: list[ServiceState] = []
        self.last: dict[str, Any] = {}

    def update(self, states: list[ServiceState], last: dict[str, Any] | None, done: int) -> None:
        self.states = states
        if last:
            self.last = last
        self.progress.update(self.task, completed=done)

    def render(self) -> Group:
        m = self.last
        n = mesh_numbers(self.states) if self.states else {}
        train = Table(
            "reward",
            "accuracy",
            "entropy",
            "clip ↑",
            "clip ↓",
            "behav KL",
            "filtered",
            "version lag",
            "gen tok/s",
            "idle",
            "spans",
            "train tok/s",
            "sync s",
            "serve s",
            title="last step",
            title_justify="left",
        )
        train.add_row(
            _fmt(m.get("reward_mean"), "+.3f"),
            _fmt(m.get("acc_mean")),
            _fmt(m.get("entropy")),
            _fmt(m.get("clip_frac_upper"), ".4f"),
            _fmt(m.get("clip_frac_lower"), ".4f"),
            _fmt(m.get("behav_kl"), ".4f"),
            _fmt(n.get("filtered_frac"), ".0%"),
            _fmt(n.get("version_lag_mean"), ".2f"),
            _fmt(n.get("rollout_tokens_per_s"), ".0f"),
            _fmt(n.get("rollout_idle_frac"), ".0%"),
            _fmt(n.get("multi_version_frac"), ".0%"),
            _fmt(m.get("tokens_per_s"), ".0f"),
            _fmt(m.get("sync_seconds"), ".2f"),
            _fmt(n.get("weight_serve_seconds_mean"), ".2f"),
        )
        health = Table("service", "port", "state", "restarts", "detail", title="services", title_justify="left")
        for st in self.states:
            state = "[green]ready" if st.ready else "[red]down" if not st.alive else "[yellow]not ready"
            health.add_row(st.name, str(st.port), state, str(st.restarts), st.detail[:60])
        return Group(self.progress, train, health)
