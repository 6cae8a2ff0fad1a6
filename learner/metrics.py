"""Prometheus metrics of the learner (dapo_learner_*)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class LearnerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"dapo_learner_{name}", doc, labels, registry=registry)

        self.step_seconds = Histogram(
            "dapo_learner_step_seconds",
            "Seconds to train one TrainBatch.",
            registry=registry,
            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )
        self.tokens_per_second = gauge("tokens_per_second", "Response tokens trained per second, last batch.")
        self.loss = gauge("loss", "Policy loss, last batch.")
        self.clip_fraction = gauge("clip_fraction", "Fraction of tokens clipped, last batch.", ("side",))
        self.entropy = gauge("entropy", "Mean token entropy, last batch.")
        self.truncated = gauge(
            "truncated_fraction",
            "Samples of the last batch cut at the length bound (what the overlong filter masks, when on).",
        )
        self.approx_kl = gauge("approx_kl", "k1 estimate of KL(old || new), last batch.")
        self.grad_norm = gauge("grad_norm", "Largest pre-clip gradient norm, last batch.")
        self.lr = gauge("lr", "Learning rate.")
        self.policy_version = gauge("policy_version", "Policy version (batches in the weights).")
        self.version_lag = Histogram(
            "dapo_learner_batch_version_lag",
            "Learner version minus the oldest sample version of a batch.",
            registry=registry,
            buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32),
        )
        self.token_lag = gauge(
            "token_version_lag",
            "Mean version lag of the last batch's response tokens (one "
            "sampled after an in-flight weight update lags less).",
        )
        self.multi_version = gauge(
            "multi_version_fraction", "Samples of the last batch whose tokens span more than one policy version."
        )
        self.behav_kl = gauge("behav_kl", "k3 estimate of KL(behaviour || proximal) over the last batch's tokens.")
        self.logp_gap = gauge("logp_gap", "|log p_proximal - log p_behaviour| per token, last batch.", ("stat",))
        self.logp_gap_by_lag = gauge(
            "logp_gap_by_lag", "Mean |log p gap| per token, by the samples' version lag.", ("lag",)
        )
        self.is_bound = gauge("offpolicy_bound_fraction", "Tokens the off-policy correction truncated or masked.")
        self.stale_groups = Counter(
            "dapo_learner_stale_groups",
            "Groups past --max-staleness at the update, by what was done (drop, reweight).",
            ["action"],
            registry=registry,
        )
        self.batches_pending = gauge("batches_pending", "Batches waiting in the stream for the learner.")
        self.batches_trained = Counter("dapo_learner_batches_trained", "Batches trained.", registry=registry)
        self.batches_skipped = Counter(
            "dapo_learner_batches_skipped", "Redelivered batches already in the weights.", registry=registry
        )
        self.checkpoint_seconds = Histogram(
            "dapo_learner_checkpoint_seconds",
            "Seconds to write a checkpoint.",
            registry=registry,
            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )

    def record(self, m: dict[str, float], version: int, lag: int) -> None:
        self.step_seconds.observe(m["seconds"])
        self.tokens_per_second.set(m["tokens_per_s"])
        self.loss.set(m.get("loss", 0.0))
        for side in ("upper", "lower", "dual"):
            self.clip_fraction.labels(side).set(m.get(f"clip_frac_{side}", 0.0))
        self.entropy.set(m.get("entropy", 0.0))
        self.truncated.set(m.get("truncated_frac", 0.0))
        self.approx_kl.set(m.get("approx_kl", 0.0))
        self.grad_norm.set(m["grad_norm"])
        self.lr.set(m["lr"])
        self.policy_version.set(version)
        self.version_lag.observe(lag)
        self.behav_kl.set(m.get("behav_kl", 0.0))
        self.logp_gap.labels("mean").set(m.get("logp_gap_mean", 0.0))
        self.logp_gap.labels("p99").set(m.get("logp_gap_p99", 0.0))
        self.is_bound.set(m.get("is_bound_frac", 0.0))
        self.token_lag.set(m.get("token_lag_mean", 0.0))
        self.multi_version.set(m.get("multi_version_frac", 0.0))
        for key, v in m.items():
            if key.startswith("logp_gap_mean_lag"):
                self.logp_gap_by_lag.labels(key.removeprefix("logp_gap_mean_lag")).set(v)
        self.batches_trained.inc()
