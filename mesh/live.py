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


def quantile(states: list[ServiceState], name: str, q: float, *, prefix: str = "", **labels: str) -> float:
    """The q-quantile of a histogram summed over the services, interpolated within its bucket as Prometheus's
    histogram_quantile does (NaN without observations)."""
    buckets: dict[float, float] = defaultdict(float)
    for st in states:
        if st.name.startswith(prefix):
            for lab, v in st.metrics.get(f"{name}_bucket", []):
                if all(lab.get(k) == x for k, x in labels.items()):
                    buckets[float(lab["le"])] += v
    edges = sorted(buckets)
    if not edges or buckets[edges[-1]] <= 0:
        return math.nan
    rank, lower, below = q * buckets[edges[-1]], 0.0, 0.0
    for le in edges:
        if buckets[le] >= rank:
            if math.isinf(le):
                return lower  # in the +Inf bucket: its lower edge, as Prometheus
            return lower + (le - lower) * (rank - below) / (buckets[le] - below) if buckets[le] > below else le
        lower, below = le, buckets[le]
    return lower


def episode_numbers(states: list[ServiceState]) -> dict[str, float]:
    """The replicas' episodes (empty when there are none): ended by outcome, turns per episode, tool calls by
    outcome, the share of episode time spent waiting for the environment, and its call latency p50 / p99."""
    ended = {lab["ended"]: 0.0 for st in states for lab, _ in st.metrics.get("dapo_rollout_episodes_total", [])}
    if not ended:
        return {}
    out = {f"episodes/{e}": value(states, "dapo_rollout_episodes_total", prefix="rollout", ended=e) for e in ended}
    waited = value(states, "dapo_rollout_episode_seconds_total", prefix="rollout", phase="env")
    generated = value(states, "dapo_rollout_episode_seconds_total", prefix="rollout", phase="generate")
    turns = value(states, "dapo_rollout_episode_turns_sum", prefix="rollout")
    finished = value(states, "dapo_rollout_episode_turns_count", prefix="rollout")
    out |= {
        "episodes_live": value(states, "dapo_rollout_episodes_live", prefix="rollout"),
        "episode_turns_mean": turns / finished if finished else math.nan,
        "env_wait_share": waited / (waited + generated) if waited + generated > 0 else math.nan,
        "env_step_p50_s": quantile(states, "dapo_rollout_env_step_seconds", 0.5, prefix="rollout", kind="step"),
        "env_step_p99_s": quantile(states, "dapo_rollout_env_step_seconds", 0.99, prefix="rollout", kind="step"),
    }
    calls = "dapo_rollout_tool_calls_total"
    outcomes = {
        lab["outcome"] for st in states if st.name.startswith("rollout") for lab, _ in st.metrics.get(calls, [])
    }
    out |= {f"tool_calls_total/{o}": value(states, calls, prefix="rollout", outcome=o) for o in outcomes}
    return out


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
    generated = value(states, "dapo_buffer_samples_generated_total", prefix="buffer")
    trained = value(states, "dapo_buffer_samples_trained_total", prefix="buffer")
    return {
        "samples_generated": generated,
        "samples_trained": trained,
        "generated_per_trained": generated / trained if trained > 0 else math.nan,
        "tokens_generated": value(states, "dapo_rollout_generated_tokens_total", prefix="rollout"),  # replicas' sum
        **rounds_numbers(states),
        "groups_received": received,
        "groups_kept": kept,
        "epoch": value(states, "dapo_buffer_epoch", prefix="buffer", how="max"),
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
        **curriculum_numbers(states),
        **episode_numbers(states),
        **gateway_numbers(states),
    }


def sampling_line(n: dict[str, float]) -> str:
    """Generated samples per trained sample, and how groups sampled in rounds went (when they were)."""
    line = f"samples: {_fmt(n.get('generated_per_trained'), '.2f')} generated per trained"
    if "group_drawn_mean" in n:
        line += (
            f"   rounds: {n['group_drawn_mean']:.1f} samples and {n['group_rounds_mean']:.1f} rounds a group, "
            f"{n['groups_given_up_frac']:.0%} given up, {n['samples_down_sampled']:.0f} down-sampled"
        )
    return line


def rounds_numbers(states: list[ServiceState]) -> dict[str, float]:
    """Groups sampled in rounds (empty when none was): samples drawn and rounds per group, given up, down-sampled."""
    groups = value(states, "dapo_rollout_group_samples_drawn_count", prefix="rollout")
    if not groups > 0:  # none, or NaN: no replica has the metric
        return {}
    drawn = value(states, "dapo_rollout_group_samples_drawn_sum", prefix="rollout")
    rounds = value(states, "dapo_rollout_group_rounds_sum", prefix="rollout")
    return {
        "group_drawn_mean": drawn / groups,
        "group_rounds_mean": rounds / groups,
        "groups_given_up_frac": value(states, "dapo_rollout_groups_given_up_total", prefix="rollout") / groups,
        "samples_down_sampled": value(states, "dapo_rollout_samples_down_sampled_total", prefix="rollout"),
    }


def gateway_numbers(states: list[ServiceState]) -> dict[str, float]:
    """The replicas' gateways (empty when none serves one): sessions by outcome and open, calls, 429s, and the
    added latency per call p50 / p99 (since the replicas started)."""
    sessions = "dapo_gateway_sessions_total"
    if not any(sessions in st.metrics for st in states if st.name.startswith("rollout")):
        return {}
    outcomes = ("opened", "ended", "abandoned")
    out = {f"gateway_sessions/{o}": value(states, sessions, prefix="rollout", outcome=o) for o in outcomes}
    return out | {
        "gateway_open": value(states, "dapo_gateway_sessions_open", prefix="rollout"),
        "gateway_calls": value(states, "dapo_gateway_calls_total", prefix="rollout", status="200"),
        "gateway_429": value(states, "dapo_gateway_rejected_total", prefix="rollout"),
        "gateway_added_p50_s": quantile(states, "dapo_gateway_added_seconds", 0.5, prefix="rollout"),
        "gateway_added_p99_s": quantile(states, "dapo_gateway_added_seconds", 0.99, prefix="rollout"),
    }


def gateway_line(n: dict[str, float]) -> str | None:
    if "gateway_open" not in n:
        return None
    s = {k.split("/", 1)[1]: v for k, v in n.items() if k.startswith("gateway_sessions/")}
    return (
        f"gateway: sessions open {_fmt(n['gateway_open'], '.0f')}, ended {_fmt(s.get('ended'), '.0f')}, abandoned "
        f"{_fmt(s.get('abandoned'), '.0f')}; calls {_fmt(n['gateway_calls'], '.0f')}, 429s "
        f"{_fmt(n['gateway_429'], '.0f')}; added per call p50 / p99 {_fmt(n['gateway_added_p50_s'])} / "
        f"{_fmt(n['gateway_added_p99_s'])} s"
    )


def curriculum_numbers(states: list[ServiceState]) -> dict[str, float]:
    """Per task: filtered fraction, groups kept, prompts skipped; the curriculum's predicted and observed filtered
    fractions (groups with a prediction: from a prompt's history or its class's) and its skip rate; prompts per
    difficulty band."""
    tasks = sorted({lab["task"] for st in states for lab, _ in st.metrics.get("dapo_buffer_task_groups_total", [])})
    out: dict[str, float] = {}
    for t in tasks:
        got = value(states, "dapo_buffer_task_groups_total", prefix="buffer", task=t)
        kept = value(states, "dapo_buffer_task_groups_total", prefix="buffer", task=t, outcome="keep")
        kept = 0.0 if math.isnan(kept) else kept
        out[f"filtered_frac/{t}"] = 1 - kept / got if got > 0 else math.nan
        out[f"groups_kept/{t}"] = kept
        out[f"skipped/{t}"] = value(states, "dapo_buffer_curriculum_skipped_total", prefix="buffer", task=t)
        out[f"heldout/{t}"] = value(states, "dapo_eval_task_avg_at_k", prefix="rollout", how="max", task=t)
    with_history = value(states, "dapo_buffer_curriculum_predicted_groups_total", prefix="buffer")
    if with_history > 0:
        out["predicted_filtered_frac"] = (
            value(states, "dapo_buffer_curriculum_predicted_filtered_total", prefix="buffer") / with_history
        )
        out["observed_filtered_frac"] = (
            value(states, "dapo_buffer_curriculum_observed_filtered_total", prefix="buffer") / with_history
        )
    skipped = value(states, "dapo_buffer_curriculum_skipped_total", prefix="buffer")
    dispatched = value(states, "dapo_buffer_prompts_dispatched_total", prefix="buffer")
    if not math.isnan(skipped) and dispatched + skipped > 0:
        out["skip_frac"] = skipped / (dispatched + skipped)
    for st in states:  # every buffer counts the same shared state: the largest count, not the sum
        for lab, v in st.metrics.get("dapo_buffer_prompts_by_band", []):
            out[f"band/{lab['band']}"] = max(out.get(f"band/{lab['band']}", 0.0), v)
    return out


def _fmt(x: Any, spec: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def episode_table(n: dict[str, float]) -> Table | None:
    """The live view's episodes row (None when the mesh runs none): counts since the replicas started."""
    if "episode_turns_mean" not in n:
        return None
    ended = {k.split("/", 1)[1]: v for k, v in n.items() if k.startswith("episodes/")}
    total = sum(v for v in ended.values() if not math.isnan(v))
    calls = {k.split("/", 1)[1]: v for k, v in n.items() if k.startswith("tool_calls_total/")}
    t = Table(
        "episodes",
        "live",
        "turns/episode",
        "truncated",
        "failed",
        "tool calls",
        "waiting for env",
        "env step p50 / p99 s",
        title="episodes",
        title_justify="left",
    )
    t.add_row(
        _fmt(total, ".0f"),
        _fmt(n.get("episodes_live"), ".0f"),
        _fmt(n.get("episode_turns_mean"), ".2f"),
        _fmt((ended.get("max_turns", 0.0) + ended.get("max_tokens", 0.0)) / total if total else math.nan, ".0%"),
        _fmt(ended.get("failed", 0.0), ".0f"),
        " ".join(f"{k} {v:.0f}" for k, v in sorted(calls.items())) or "-",
        _fmt(n.get("env_wait_share"), ".0%"),
        f"{_fmt(n.get('env_step_p50_s'), '.3f')} / {_fmt(n.get('env_step_p99_s'), '.3f')}",
    )
    return t


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
        tasks = Table(
            "task", "filtered", "groups kept", "skipped", "held-out avg@k", title="tasks", title_justify="left"
        )
        for t in sorted(k.split("/", 1)[1] for k in n if k.startswith("filtered_frac/")):
            tasks.add_row(
                t,
                _fmt(n.get(f"filtered_frac/{t}"), ".0%"),
                _fmt(n.get(f"groups_kept/{t}"), ".0f"),
                _fmt(n.get(f"skipped/{t}"), ".0f"),
                _fmt(n.get(f"heldout/{t}")),
            )
        episodes = episode_table(n)
        bands = "  ".join(f"{k.split('/', 1)[1]} {v:.0f}" for k, v in n.items() if k.startswith("band/"))
        if "predicted_filtered_frac" in n:
            bands += (
                f"   curriculum: predicted filtered {n['predicted_filtered_frac']:.0%}, observed "
                f"{n['observed_filtered_frac']:.0%}, skipped {n.get('skip_frac', 0.0):.0%}"
            )
        health = Table("service", "port", "state", "restarts", "detail", title="services", title_justify="left")
        for st in self.states:
            state = "[green]ready" if st.ready else "[red]down" if not st.alive else "[yellow]not ready"
            health.add_row(st.name, str(st.port), state, str(st.restarts), st.detail[:60])
        parts: list[Any] = [self.progress, train]
        if tasks.row_count:
            parts.append(tasks)
        if episodes is not None:
            parts.append(episodes)
        if bands:
            parts.append(f"prompts by band: {bands}")
        if (gateway := gateway_line(n)) is not None:
            parts.append(gateway)
        parts.append(sampling_line(n))
        return Group(*parts, health)
