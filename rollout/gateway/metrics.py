"""Prometheus metrics of the gateway (dapo_gateway_*), on the replica's registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.open = Gauge("dapo_gateway_sessions_open", "Gateway sessions open now.", registry=r)
        self.sessions = Counter(
            "dapo_gateway_sessions",
            "Gateway sessions by what became of them: opened, ended, abandoned, failed.",
            ["outcome"],
            registry=r,
        )
        self.calls = Counter(
            "dapo_gateway_calls",
            "Model calls through the gateway, by route and answer.",
            ["route", "status"],
            registry=r,
        )
        self.tokens = Counter(
            "dapo_gateway_tokens",
            "Tokens of gateway calls: prompt (as rendered) and completion (sampled).",
            ["kind"],
            registry=r,
        )
        self.added = Histogram(
            "dapo_gateway_added_seconds",
            "Seconds a call spent outside the engine: the gateway's own latency (parsing, rendering, waiting for "
            "the loop, answering).",
            registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.rejected = Counter(
            "dapo_gateway_rejected",
            "Requests answered 429: no task handed out in time (the buffer holds back for "
            "staleness or capacity), sessions or calls at their bound.",
            ["reason"],
            registry=r,
        )
        self.segments = Counter(
            "dapo_gateway_segments",
            "Segments begun after the first of a session: its history was rewritten.",
            registry=r,
        )
        self.cancelled = Counter(
            "dapo_gateway_cancelled",
            "Calls whose sequences were taken out of the engine unfinished (the client "
            "went away mid-stream, or a time limit).",
            registry=r,
        )
        self.groups = Counter(
            "dapo_gateway_groups", "Task groups of sessions: published, dead-lettered.", ["outcome"], registry=r
        )
