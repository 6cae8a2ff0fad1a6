"""The environment service's Prometheus metrics (all `dapo_env_*`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

STEP_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class EnvMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("dapo_env_requests", "Requests answered.", ["route", "status"], registry=registry)
        self.episodes_open = Gauge("dapo_env_episodes_open", "Episodes held now.", registry=registry)
        self.episodes = Counter(
            "dapo_env_episodes",
            "Episodes ended: success (reward > 0), failure, truncated, error (the environment failed), "
            "expired (idle past the TTL), closed (by the client before done).",
            ["env", "outcome"],
            registry=registry,
        )
        self.turns = Histogram(
            "dapo_env_episode_turns",
            "Model turns of each finished episode.",
            ["env"],
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
            registry=registry,
        )
        self.step_seconds = Histogram(
            "dapo_env_step_latency_seconds",
            "Time of one reset or step in environment code.",
            ["env", "kind"],
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.tool_calls = Counter(
            "dapo_env_tool_calls",
            "Tool calls: valid, malformed, unknown, failed.",
            ["env", "outcome"],
            registry=registry,
        )
        self.timeouts = Counter(
            "dapo_env_timeouts", "Resets and steps over --step-timeout-s.", ["env"], registry=registry
        )
        self.workers_stuck = Gauge(
            "dapo_env_workers_stuck", "Worker threads still in environment code after its timeout.", registry=registry
        )
